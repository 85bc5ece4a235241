"""min_tokens holds off stop sequences and stop strings (vLLM's rule: none ends the output until more than
min_tokens tokens were produced); EOS and stop ids are the worker's mask (workers/penalties.py)."""

from __future__ import annotations

from engine.core.stop_conditions import StopChecker, StopReason
from engine.core.text_stream import TextStream


def _feed(checker: StopChecker, toks: list[int]) -> tuple[list[int], StopReason | None]:
    shown: list[int] = []
    for t in toks:
        emit, _, stop = checker.feed(t)
        shown += emit
        if stop is not None:
            return shown, stop
    return shown, None


def test_a_stop_sequence_before_min_tokens_is_output_and_one_after_ends_it():
    toks = [5, 7, 8, 1, 7, 8, 2]
    plain = StopChecker.build(20, [], False, [], [[7, 8]], [])
    assert _feed(plain, toks) == ([5], StopReason.STOP)
    held = StopChecker.build(20, [], False, [], [[7, 8]], [], min_tokens=3)
    assert _feed(held, toks) == ([5, 7, 8, 1], StopReason.STOP)  # the second [7, 8] ends at token 6 > 3
    resumed = StopChecker.build(20, [], False, [], [[7, 8]], [5, 7], min_tokens=3)  # a continuation counts
    assert _feed(resumed, [8, 1, 7, 8]) == ([8, 1], StopReason.STOP)


def test_a_stop_string_before_min_tokens_is_text_and_one_after_ends_it():
    pieces = [b"a", b"b", b"X", b"c", b"X", b"d"]

    def run(ts: TextStream) -> tuple[str, bool]:
        out = ""
        for p in pieces:
            step = ts.feed(p)
            out += step.text
            if step.stopped:
                return out, True
        return out + ts.finish().text, False

    assert run(TextStream(["X"])) == ("ab", True)
    assert run(TextStream(["X"], min_tokens=3)) == ("abXc", True)
    assert run(TextStream(["X"], min_tokens=6)) == ("abXcXd", False)
    primed = TextStream(["cX"], min_tokens=3)
    assert not primed.prime([b"a", b"b"])  # a resumed stream's continuation counts toward min_tokens
    c, x = primed.feed(b"c"), primed.feed(b"X")  # "cX" completes at token 4 (> 3): it ends the text
    assert (c.text, c.stopped, x.text, x.stopped) == ("", False, "", True)
    early = TextStream(["cX"], min_tokens=4)
    assert not early.prime([b"a", b"b"])
    c, x = early.feed(b"c"), early.feed(b"X")  # at token 4 (not > 4): text
    assert (c.text, x.text, x.stopped) == ("", "cX", False)
