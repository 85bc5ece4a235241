"""The scheduler with a tokenizer: text deltas beside the ids, stop strings that end requests and free lanes."""

from __future__ import annotations

import codecs

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.actions import EmitTokens, FailRequest
from test_scheduler_fakes import EOS, FakeExecutor, default_token, kv_fully_free, make_scheduler, params

N_PROMPT = 8  # params(n_prompt=8): the first generated token sits at position 8


def piece(t: int) -> bytes:
    """Byte-level: ids 1..255 are bytes, the rest (EOS = 0 included) carry no text."""
    return bytes([t]) if 0 < t < 256 else b""


def says(text: str | bytes, then: dict[int, int] | None = None):
    """Token function: the bytes of `text` from the first generated position on, then `then` / the default."""
    data = text.encode() if isinstance(text, str) else text
    script = {N_PROMPT + i: b for i, b in enumerate(data)}
    script.update(then or {})
    return lambda seed, pos: script.get(pos, default_token(seed, pos) % 200 + 300)  # no text outside the script


def run(token_fn, **kw) -> FakeExecutor:
    ex = FakeExecutor(make_scheduler(piece=piece), token_fn=token_fn)
    ex.submit(1, params(n_prompt=N_PROMPT, **kw))
    ex.run()
    return ex


def test_text_deltas_follow_the_tokens_and_never_split_a_character():
    ex = run(says("h€llo"), max_tokens=len("h€llo".encode()))
    assert ex.terminal[1].finish_reason == "length"
    assert "".join(ex.texts[1]) == "h€llo"
    assert ex.tokens[1] == list("h€llo".encode())  # ids are emitted as generated
    assert "€" in ex.texts[1] and "\ufffd" not in "".join(ex.texts[1])  # the 3 bytes arrive as one delta


def test_stop_string_ends_the_request_at_the_token_completing_it_and_frees_the_lane():
    ex = run(says("one END two"), max_tokens=100, stop_strings=["END"])
    done = ex.terminal[1]
    assert done.finish_reason == "stop"
    assert "".join(ex.texts[1]) == "one "
    # the ids of the stop string are emitted (the raw output); nothing after its last token is generated
    assert ex.tokens[1] == list(b"one END")
    assert done.usage["completion_tokens"] == len("one END")
    assert kv_fully_free(ex.sched)


def test_stop_string_at_the_very_start_gives_empty_text():
    ex = run(says("STOP here"), max_tokens=50, stop_strings=["ST", "nothing"])
    assert ex.terminal[1].finish_reason == "stop"
    assert "".join(ex.texts.get(1, [])) == ""
    assert ex.tokens[1] == list(b"ST")


def test_held_text_is_flushed_as_a_text_only_delta_when_generation_ends_otherwise():
    # "EN" could start "END": held; then EOS ends the request and the held text is shown after all
    ex = run(says("xEN", then={N_PROMPT + 3: EOS}), max_tokens=50, stop_strings=["END"])
    assert ex.terminal[1].finish_reason == "eos"
    assert "".join(ex.texts[1]) == "xEN"
    sched_actions = [a for a in ex.order if a[0] == "tokens"]
    assert len(sched_actions) == 4  # x, E, N, then the flush without tokens
    assert ex.tokens[1] == list(b"xEN")


def test_first_stop_string_to_complete_wins_among_several():
    ex = run(says("abcdef"), max_tokens=50, stop_strings=["abcd", "bc", "zz"])
    assert ex.terminal[1].finish_reason == "stop"
    assert "".join(ex.texts[1]) == "a"
    assert ex.tokens[1] == list(b"abc")


def test_invalid_utf8_is_replaced_and_a_truncated_character_flushed_at_length():
    ex = run(says(b"a\xffb\xe2\x82"), max_tokens=5)
    assert "".join(ex.texts[1]) == "a\ufffdb\ufffd"


def test_token_stop_sequences_and_stop_strings_together():
    # the token-id stop [69, 78] ("EN") hides its tokens; the text never shows them either
    ex = run(says("xyENz"), max_tokens=50, stop=[[69, 78]], stop_strings=["zz"])
    assert ex.terminal[1].finish_reason == "stop"
    assert ex.tokens[1] == list(b"xy") and "".join(ex.texts[1]) == "xy"


def test_continuation_is_replayed_so_a_stop_string_can_span_the_resume():
    ex = FakeExecutor(make_scheduler(piece=piece), token_fn=says("", then={N_PROMPT + 3: ord("D")}))
    ex.submit(1, params(n_prompt=N_PROMPT, max_tokens=20, stop_strings=["END"], continuation=list(b"xEN")))
    ex.run()
    assert ex.terminal[1].finish_reason == "stop"
    assert "".join(ex.texts.get(1, [])) == ""  # "x" was shown by the first server; "EN" is cut
    # a continuation that already holds a stop string finishes at once
    ex.submit(2, params(n_prompt=N_PROMPT, max_tokens=20, stop_strings=["EN"], continuation=list(b"xEN")))
    assert ex.terminal[2].finish_reason == "stop" and 2 not in ex.tokens


def test_batched_requests_stop_independently():
    ex = FakeExecutor(make_scheduler(piece=piece), token_fn=lambda seed, pos: b"abc.def.ghi.jkl"[
        (pos - N_PROMPT + seed) % 15])
    for rid in range(1, 9):
        ex.submit(rid, params(n_prompt=N_PROMPT, seed=rid, max_tokens=30, stop_strings=["."] if rid % 2 else []))
    ex.run()
    for rid in range(1, 9):
        text = "".join(ex.texts[rid])
        if rid % 2:
            assert ex.terminal[rid].finish_reason == "stop" and "." not in text
            assert len(ex.tokens[rid]) <= 4
        else:
            assert ex.terminal[rid].finish_reason == "length" and len(text) == 30
    assert kv_fully_free(ex.sched)


def test_string_stops_without_a_tokenizer_are_refused():
    s = make_scheduler()
    out = s.submit(1, params(stop_strings=["x"]), 0.0)
    assert len(out) == 1 and isinstance(out[0], FailRequest)
    assert (out[0].code, out[0].reason) == (400, "no_tokenizer")


def test_without_a_tokenizer_no_text_is_produced():
    ex = FakeExecutor(make_scheduler(), token_fn=says("abc"))
    ex.submit(1, params(n_prompt=N_PROMPT, max_tokens=3))
    ex.run()
    assert ex.tokens[1] == list(b"abc") and 1 not in ex.texts


def test_logprobs_stay_aligned_with_the_emitted_tokens_on_a_stop_string():
    s = make_scheduler(piece=piece)
    ex = FakeExecutor(s, token_fn=says("ab|cd"))
    emitted: list[EmitTokens] = []
    orig = ex.handle

    def spy(actions):
        emitted.extend(a for a in actions if isinstance(a, EmitTokens))
        orig(actions)

    ex.handle = spy
    ex.submit(1, params(n_prompt=N_PROMPT, max_tokens=20, logprobs=True, stop_strings=["|"]))
    ex.run()
    assert all(len(a.logprobs) == len(a.tokens) for a in emitted)
    assert sum(len(a.tokens) for a in emitted) == 3


_ALPHABET = "ab\n é€"


@settings(max_examples=120, deadline=None)
@given(text=st.text(alphabet=_ALPHABET, min_size=1, max_size=24), junk=st.binary(max_size=3),
       stops=st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=3), max_size=3))
def test_scheduler_text_matches_the_oracle(text, junk, stops):
    """Through the scheduler: text = decode(output) cut at the first stop; ids up to the completing token."""
    data = text.encode() + junk
    data = bytes(b if b else 1 for b in data)  # byte 0 is this model's EOS
    ex = FakeExecutor(make_scheduler(piece=piece), token_fn=says(data))
    ex.submit(1, params(n_prompt=N_PROMPT, max_tokens=len(data), stop_strings=stops))
    ex.run()
    full = data.decode("utf-8", "replace")
    hits = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    want = full[:min(hits)[1]] if hits else full
    assert "".join(ex.texts.get(1, [])) == want
    assert ex.terminal[1].finish_reason == ("stop" if hits else "length")
    ids = ex.tokens.get(1, [])
    assert bytes(ids) == data[:len(ids)]
    if hits:  # stopped at the token that completed the stop string, not later
        seen = codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(ids[:-1]))
        assert not any(s in seen for s in stops)
    assert kv_fully_free(ex.sched)
