"""The hand-off descriptor and the exporter's table of held KV, on a fake clock."""

from __future__ import annotations

import pytest

from engine.core.handoff import (HandoffDescriptor, HandoffError, HandoffTable, HeldState, ImportOutcome,
                                 take_over)
from ipc.schema import ProtocolError, validate_request


def test_descriptor_round_trips_through_the_wire_schema():
    d = HandoffDescriptor("tcp://p:1", "g7", prompt_len=40, blocks=(3, 4, 9),
                          layout={"generation": "g1", "block_size": 16}, first_token=42)
    msg = validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1, 2], "handoff": d.to_wire()})
    assert HandoffDescriptor.from_wire(msg["handoff"]) == d
    assert d.exported and not HandoffDescriptor("b", "r").exported


@pytest.mark.parametrize("bad", [
    [], {"board": "b"}, {"export": True, "board": "b"}, {"board": "b", "request": "r", "blocks": [-1]},
    {"board": "b", "request": "r", "layout": {"k": [1]}}, {"board": "b", "request": "r", "extra": 1},
    {"board": "", "request": "r"}, {"export": 1},
])
def test_the_schema_refuses_bad_handoffs(bad):
    with pytest.raises(ProtocolError):
        validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1], "handoff": bad})


def test_the_host_pool_field_names_a_segment_or_is_refused():
    hp = {"name": "/npuserve-1-2-kvh", "slots": 8, "slot_bytes": 4160, "layout": "00ff" * 4, "host": "h/boot"}
    msg = validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1],
                            "handoff": {"board": "b", "request": "r", "host_pool": hp}})
    assert msg["handoff"]["host_pool"] == hp
    for bad in ({**hp, "slots": 0}, {**hp, "extra": 1}, {k: v for k, v in hp.items() if k != "host"}, "x"):
        with pytest.raises(ProtocolError):
            validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1],
                              "handoff": {"board": "b", "request": "r", "host_pool": bad}})


def test_an_export_leg_is_just_the_flag():
    msg = validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1], "handoff": {"export": True}})
    assert msg["handoff"] == {"export": True}
    assert "handoff" not in validate_request({"v": 1, "op": "generate", "id": "a", "prompt": [1]})


def test_claimed_then_released_frees_once():
    t = HandoffTable(deadline_s=5.0)
    t.hold("h1", [1, 2, 3], now=0.0)
    assert t.held_blocks() == 3 and t.next_deadline() == 5.0
    h = t.claim("h1", now=1.0)
    assert h is not None and h.state is HeldState.CLAIMED
    assert t.claim("h1", now=1.5) is None  # one decode board only
    assert t.release("h1") == (1, 2, 3)
    assert t.release("h1") == ()
    assert t.expire(100.0) == [] and len(t) == 0 and t.next_deadline() is None


def test_the_deadline_frees_an_unclaimed_and_a_stalled_claim():
    t = HandoffTable(deadline_s=2.0)
    t.hold("a", [1], now=0.0)
    t.hold("b", [2, 3], now=1.0)
    t.claim("b", now=1.5)  # a decode board that stalls mid-transfer
    assert t.expire(1.9) == []
    assert t.expire(2.0) == [("a", (1,))]
    assert t.claim("a", now=2.1) is None  # too late: the decode board recomputes
    assert t.expire(3.0) == [("b", (2, 3))]
    assert t.held_blocks() == 0 and t.counters["expired"] == 2 and t.counters["refused"] == 1


def test_claim_at_the_deadline_is_refused_and_holds_are_unique():
    t = HandoffTable(deadline_s=1.0)
    t.hold("a", [1], now=0.0)
    assert t.claim("a", now=1.0) is None
    with pytest.raises(HandoffError):
        t.hold("a", [2], now=0.5)


class _Sink:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def stage(self, desc, tokens, salt):
        self.calls += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_take_over_imports_only_what_was_exported_and_falls_back_to_recompute():
    exported = HandoffDescriptor("b", "r", prompt_len=32, blocks=(1, 2))
    assert take_over(exported, _Sink(2)) == (ImportOutcome.IMPORTED, 2)
    assert take_over(exported, _Sink(0)) == (ImportOutcome.RECOMPUTED, 0)
    assert take_over(exported, _Sink(RuntimeError("checksum"))) == (ImportOutcome.RECOMPUTED, 0)
    assert take_over(exported, None) == (ImportOutcome.RECOMPUTED, 0)
    sink = _Sink(2)
    assert take_over(HandoffDescriptor("b", "r"), sink)[0] is ImportOutcome.RECOMPUTED and sink.calls == 0
    assert take_over(None, sink)[0] is ImportOutcome.RECOMPUTED
