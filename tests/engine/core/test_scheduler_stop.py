"""Stop conditions: max_tokens, EOS, stop token ids, multi-token stop sequences across jobs and the continuation."""

from __future__ import annotations

from engine.core.stop_conditions import StopChecker, StopReason
from test_scheduler_fakes import EOS, FakeExecutor, make_scheduler, params


def feed_all(ch: StopChecker, toks):
    shown, reason = [], None
    for t in toks:
        v = ch.feed(t)
        shown += v.emit
        if v.stop:
            reason = v.stop
            break
    return shown, reason


def checker(max_tokens=100, ignore_eos=False, stop_ids=(), stop=(), continuation=()):
    return StopChecker.build(max_tokens, (EOS,), ignore_eos, stop_ids, stop, continuation)


def test_max_tokens_eos_and_stop_ids():
    assert feed_all(checker(max_tokens=3), [5, 6, 7, 8]) == ([5, 6, 7], StopReason.LENGTH)
    assert feed_all(checker(), [5, EOS, 7]) == ([5], StopReason.EOS)
    assert feed_all(checker(max_tokens=3, ignore_eos=True), [5, EOS, 7]) == ([5, EOS, 7], StopReason.LENGTH)
    assert feed_all(checker(stop_ids=[9]), [5, 9, 7]) == ([5], StopReason.STOP)


def test_stop_sequence_is_hidden_and_partial_matches_are_released():
    assert feed_all(checker(stop=[[7, 8, 9]]), [1, 7, 8, 2, 7, 8, 9, 4]) == ([1, 7, 8, 2], StopReason.STOP)
    # a partial match cut off by max_tokens is shown
    assert feed_all(checker(max_tokens=3, stop=[[7, 8, 9]]), [1, 7, 8]) == ([1, 7, 8], StopReason.LENGTH)
    # overlapping prefixes: 7 7 8 ends with stop [7, 8]
    assert feed_all(checker(stop=[[7, 8]]), [7, 7, 8]) == ([7], StopReason.STOP)


def test_stop_sequence_starting_inside_the_continuation():
    ch = checker(max_tokens=10, stop=[[3, 4, 5]], continuation=[1, 3])
    assert ch.produced == 2
    assert feed_all(ch, [4, 5, 6]) == ([], StopReason.STOP)
    ch = checker(max_tokens=10, stop=[[3, 4, 5]], continuation=[1, 3])
    assert feed_all(ch, [4, 6, 6])[0] == [4, 6, 6]


def scripted(script: dict[int, int]):
    """Token function: the stub default except at the scripted positions."""
    from test_scheduler_fakes import default_token

    return lambda seed, pos: script.get(pos, default_token(seed, pos))


def test_scheduler_finish_reasons_and_stop_sequence_across_decode_jobs():
    s = make_scheduler()
    ex = FakeExecutor(s, token_fn=scripted({10: 501, 11: 502, 12: 503, 14: EOS}))
    ex.submit(1, params(n_prompt=8, max_tokens=20, seed=1, stop=[[502, 503]]))  # tokens at positions 8, 9, 10..
    ex.submit(2, params(n_prompt=8, max_tokens=20, seed=2))  # runs into EOS at position 14
    ex.submit(3, params(n_prompt=8, max_tokens=20, seed=3, stop_token_ids=[501]))
    ex.submit(4, params(n_prompt=8, max_tokens=20, seed=4, ignore_eos=True))
    ex.run()
    assert ex.terminal[1].finish_reason == "stop" and ex.tokens[1][-1] == 501 and len(ex.tokens[1]) == 3
    assert ex.terminal[1].usage["completion_tokens"] == 5  # 502 and 503 were generated, not shown
    assert ex.terminal[2].finish_reason == "eos" and len(ex.tokens[2]) == 6 and EOS not in ex.tokens[2]
    assert ex.terminal[3].finish_reason == "stop" and len(ex.tokens[3]) == 2
    assert ex.terminal[4].finish_reason == "length" and len(ex.tokens[4]) == 20 and EOS in ex.tokens[4]


def test_eos_on_the_first_token_finishes_after_prefill():
    s = make_scheduler()
    ex = FakeExecutor(s, token_fn=scripted({8: EOS}))
    ex.submit(1, params(n_prompt=8, max_tokens=20))
    ex.run()
    assert ex.terminal[1].finish_reason == "eos" and 1 not in ex.tokens
    assert ex.terminal[1].timing["ttft_ms"] is not None
