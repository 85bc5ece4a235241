"""A board's side of a prefill/decode hand-off: what a generate's `handoff` field does here.

A decode leg's descriptor goes to the board's KV sink (`engine.core.handoff.take_over`); until the board
has one (the backend export/import of issue 22), every take-over recomputes the prompt, which is what the
request's `continuation` already asks for, so the output is the co-located run's. An export leg on a board
without an export capability holds nothing: its decode board recomputes. The counters say which happened.
"""

from __future__ import annotations

from engine.core.handoff import HandoffDescriptor, ImportOutcome, KvHandoffSink, take_over

HANDOFF_COUNTER_KEYS = ("handoff_exports", "handoff_exported", "handoff_imported", "handoff_recomputed")


def note_handoff(counters: dict[str, int], handoff: dict, sink: KvHandoffSink | None = None) -> ImportOutcome | None:
    """Count (and, with a sink, import) one generate's hand-off; None for an export leg."""
    if handoff.get("export"):
        counters["handoff_exports"] = counters.get("handoff_exports", 0) + 1
        return None
    outcome = take_over(HandoffDescriptor.from_wire(handoff), sink)
    key = f"handoff_{outcome.value}"
    counters[key] = counters.get(key, 0) + 1
    return outcome
