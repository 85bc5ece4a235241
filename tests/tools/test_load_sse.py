"""The SSE decoder of the HTTP load driver: blocks split anywhere, line-end styles, multi-line data, comments."""

from __future__ import annotations

from hypothesis import given, strategies as st

from tools.load.sse import SseDecoder, SseEvent

STREAM = (b'data: {"a":1}\n\n'
          b": ping\n\n"
          b"event: error\ndata: {\"error\":\n"
          b"data: 2}\n\n"
          b"id: 7\nretry: 10\n\n"
          b"data:[DONE]\n\n")
EVENTS = [SseEvent("message", b'{"a":1}'), SseEvent("error", b'{"error":\n2}'), SseEvent("message", b"[DONE]")]


def _decode(chunks: list[bytes]) -> list[SseEvent]:
    d = SseDecoder()
    return [ev for c in chunks for ev in d.feed(c)]


def test_whole_stream_in_one_chunk():
    assert _decode([STREAM]) == EVENTS


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_of_the_stream_gives_the_same_events(cuts):
    cuts = sorted(cuts)
    chunks = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)])]
    assert _decode(chunks) == EVENTS


@given(st.sampled_from([b"\r\n", b"\r"]), st.lists(st.integers(0, 80), max_size=8))
def test_crlf_and_cr_line_ends_split_anywhere(eol, cuts):
    stream = STREAM.replace(b"\n", eol)
    cuts = sorted(c for c in cuts if c <= len(stream))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    assert _decode(chunks) == EVENTS


def test_a_partial_block_waits_and_is_visible_as_pending():
    d = SseDecoder()
    assert d.feed(b'data: {"x"') == [] and d.pending == b'data: {"x"'
    assert d.feed(b":2}\n") == []
    assert d.feed(b"\n") == [SseEvent("message", b'{"x":2}')] and d.pending == b""


def test_llama_cpp_error_field_reads_as_an_error_event():
    assert _decode([b'error: {"code":500,"message":"boom"}\n\n']) == [SseEvent("error", b'{"code":500,"message":"boom"}')]


def test_an_empty_chunk_between_cr_and_lf_is_not_a_line_end():
    assert _decode([b"data: a\r", b"", b"\n\r\n"]) == [SseEvent("message", b"a")]
    assert _decode([b"data: a\r", b"\n", b"data: b\r\n\r\n"]) == [SseEvent("message", b"a\nb")]
