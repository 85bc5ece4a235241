"""A request's output constraint (structured output) as the scheduler carries it to the chip.

The daemon compiles and validates the client's constraint at admission
(`engine.daemon.constraint_cache`); the scheduler only threads the result
onto each lane of the request's jobs (`lane_fields`), so that the worker can
build and advance the request's matcher (`workers.constraints`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConstraintSpec:
    """A compiled constraint: `grammar` is llguidance's grammar text, `id` its 64-bit hash (never 0)."""

    id: int
    grammar: str
    kind: str  # the client's kind (json_schema, json_object, regex, lark, gbnf): for stats and logs


def lane_fields(spec: ConstraintSpec, request_id: int, tokens: list[int], prompt_len: int, end: int,
                prefill_target: int) -> dict:
    """The constraint fields of a lane whose KV ends at `end` (ipc.records.Lane's constraint_*).

    The lane that ends the (re)prefill carries the grammar and every output
    token so far (continuation included), from which the worker rebuilds the
    matcher; a decode lane carries only the id and the output count.
    """
    done = end - prompt_len
    if end == prefill_target:
        return {"constraint": spec.id, "constraint_key": request_id, "constraint_done": done,
                "replay": tokens[prompt_len:end], "grammar": spec.grammar}
    return {"constraint": spec.id, "constraint_key": request_id, "constraint_done": done}
