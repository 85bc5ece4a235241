"""The error event's retry_after_ms: built only when given, validated as a non-negative int when present,
and an event without it (an older server) still valid."""

from __future__ import annotations

import pytest

from ipc.schema import ProtocolError, error_event, validate_event


def test_error_event_carries_retry_after_ms_only_when_given():
    ev = error_event("r1", 429, "queue_full", "too many waiting requests", retryable=True, retry_after_ms=1500)
    assert ev["retry_after_ms"] == 1500 and validate_event(ev) is ev
    plain = error_event("r1", 400, "bad_type", "x")
    assert "retry_after_ms" not in plain and validate_event(plain) is plain


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True, [1]])
def test_a_malformed_retry_after_ms_is_a_protocol_error(bad):
    ev = {**error_event("r1", 503, "draining", "m", retryable=True), "retry_after_ms": bad}
    with pytest.raises(ProtocolError) as e:
        validate_event(ev)
    assert e.value.reason in ("bad_type", "out_of_range") and "retry_after_ms" in e.value.message


def test_a_null_retry_after_ms_reads_as_absent():
    ev = {**error_event("r1", 503, "draining", "m", retryable=True), "retry_after_ms": None}
    assert validate_event(ev) is ev
