"""The incremental detokenizer / stop-string matcher against a one-line oracle."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.text_stream import TextStream


def oracle(data: bytes, stops: list[str]) -> tuple[str, bool]:
    """decode(all bytes), cut before the stop string that completes first (earliest start on a tie)."""
    text = data.decode("utf-8", "replace")
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[:min(hits)[1]], True) if hits else (text, False)


def run(pieces: list[bytes], stops: list[str]) -> tuple[list[str], bool, int]:
    """Feed pieces until a stop; returns (deltas, stopped, pieces consumed)."""
    ts = TextStream(stops)
    deltas: list[str] = []
    for i, p in enumerate(pieces):
        step = ts.feed(p)
        deltas.append(step.text)
        if step.stopped:
            assert ts.stopped
            return deltas, True, i + 1
    step = ts.finish()
    deltas.append(step.text)
    return deltas, step.stopped, len(pieces)


# Text with multi-byte characters and stop-string material, split at arbitrary byte offsets.
_ALPHABET = "ab\n é€😀"
_texts = st.text(alphabet=_ALPHABET, max_size=40)
_stops = st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), max_size=4)


@st.composite
def split_bytes(draw, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=len(data) + 1)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]  # empty pieces included: special tokens


@settings(max_examples=400, deadline=None)
@given(data=st.data(), text=_texts, garbage=st.binary(max_size=6), stops=_stops)
def test_deltas_concatenate_to_the_oracle(data, text: str, garbage: bytes, stops: list[str]) -> None:
    raw = text.encode() + garbage + text[: len(text) // 2].encode()  # invalid and truncated UTF-8 too
    pieces = data.draw(split_bytes(raw))
    deltas, stopped, used = run(pieces, stops)
    want, want_stop = oracle(raw, stops)
    assert "".join(deltas) == want
    assert stopped == want_stop
    # Never shown too early: after each piece the text so far is a prefix of the final answer,
    # and a stop ends the stream at the piece that completes it (no piece after it is needed).
    shown = ""
    for d in deltas:
        shown += d
        assert want.startswith(shown)
    if stopped:  # the stream stops at the piece that completes the stop string, not later
        assert oracle(b"".join(pieces[:used]), stops) == (want, True)

@settings(max_examples=200, deadline=None)
@given(data=st.data(), text=st.text(max_size=30))
def test_no_stop_strings_every_prefix_is_whole_characters(data, text: str) -> None:
    raw = text.encode()
    pieces = data.draw(split_bytes(raw))
    ts = TextStream()
    shown = ""
    for i, p in enumerate(pieces):
        shown += ts.feed(p).text
        consumed = b"".join(pieces[: i + 1])
        # exactly the whole characters received so far: nothing held back, nothing split
        assert shown == consumed.decode("utf-8", "ignore")
        assert "\ufffd" not in shown
    assert shown + ts.finish().text == text


def test_multibyte_character_split_across_tokens() -> None:
    ts = TextStream()
    euro = "€".encode()  # 3 bytes
    assert [ts.feed(euro[:1]).text, ts.feed(euro[1:2]).text, ts.feed(euro[2:] + b"!").text] == ["", "", "€!"]
    emoji = "😀".encode()  # 4 bytes, 2 tokens
    assert ts.feed(emoji[:2]).text == ""
    assert ts.feed(emoji[2:]).text == "😀"
    assert ts.finish().text == ""


def test_truncated_character_at_the_end_is_one_replacement_character() -> None:
    ts = TextStream()
    assert ts.feed(b"ok" + "€".encode()[:2]).text == "ok"
    assert ts.finish().text == "\ufffd"


def test_stop_string_spanning_tokens_is_held_then_cut() -> None:
    ts = TextStream(["END"])
    assert ts.feed(b"abc E").text == "abc "
    assert ts.feed(b"N").text == ""
    step = ts.feed(b"Dxyz")
    assert step == step.__class__("", True) and ts.stopped


def test_held_prefix_is_released_when_it_cannot_be_a_stop() -> None:
    ts = TextStream(["END"])
    assert ts.feed(b"EN").text == ""
    assert ts.feed(b"X").text == "ENX"
    assert ts.feed(b"E").text == ""
    assert ts.finish().text == "E"  # generation ended for another reason: the held text is shown


def test_stop_string_at_the_very_start() -> None:
    ts = TextStream(["He"])
    assert ts.feed(b"H").text == ""
    assert ts.feed(b"ello").text == "" and ts.stopped


def test_overlapping_stop_strings_first_to_complete_wins() -> None:
    # "abcd" starts first but "bc" completes first: the text ends before "bc"
    ts = TextStream(["abcd", "bc"])
    assert [ts.feed(bytes([c])).text for c in b"xab"] == ["x", "", ""]
    step = ts.feed(b"c")
    assert step.stopped and step.text == "a"
    # same end: the one starting first (the longer) cuts
    ts = TextStream(["c", "abc"])
    step = ts.feed(b"zabc")
    assert step.stopped and step.text == "z"


def test_several_stop_strings_any_of_them_stops() -> None:
    for stops, want in ((["\n\n", "###", "Q:"], "one\ntwo "), (["#", "Q:"], "one\ntwo ")):
        ts = TextStream(stops)
        out = ""
        for p in (b"one\n", b"two ", b"##", b"#", b" Q: more"):
            step = ts.feed(p)
            out += step.text
            if step.stopped:
                break
        assert out == want and ts.stopped


def test_stop_string_made_of_multibyte_characters_split_inside_a_character() -> None:
    stop = "€€"
    data = ("a€b" + stop + "c").encode()
    ts = TextStream([stop])
    out = ""
    for i in range(len(data)):
        step = ts.feed(data[i:i + 1])
        out += step.text
        if step.stopped:
            break
    assert out == "a€b" and ts.stopped


def test_empty_pieces_are_special_tokens_without_text() -> None:
    ts = TextStream(["x"])
    assert ts.feed(b"").text == ""
    assert ts.feed(b"ab").text == "ab"
    assert ts.feed(b"").text == ""


def test_prime_replays_a_continuation_silently() -> None:
    euro = "€".encode()
    ts = TextStream(["STOP"])
    assert ts.prime([b"hello ", b"ST", euro[:1]]) is False
    # the held "ST" and the half euro carry over: shown once completed / released
    assert ts.feed(euro[1:2]).text == ""
    assert ts.feed(euro[2:]).text == "ST€"
    ts2 = TextStream(["lo"])
    assert ts2.prime([b"hel", b"lo"]) is True and ts2.stopped
