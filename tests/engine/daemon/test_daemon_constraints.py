"""Structured output through a real daemon on the tiny `ref` model: admission, requeue, resume."""

from __future__ import annotations

import json

import jsonschema
import pytest

from chip_faults import frozen_then_killed
from daemon_procs import daemon_process
from engine.errors import InvalidRequest

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["n", "kind"], "additionalProperties": False}
CONSTRAINT = {"kind": "json_schema", "body": SCHEMA}
# every output SCHEMA accepts, in the separators the constraint compiles with (docs/protocol.md, Structured
# output); the longest is 23 bytes
DOCUMENTS = [json.dumps(d, separators=(", ", ": ")) for n in range(1000) for k in "ab"
             for d in ({"n": n, "kind": k}, {"kind": k, "n": n})]


@pytest.fixture(scope="module")
def board():
    with daemon_process("ref", chips=2, settings={"recovery.heartbeat_timeout_ms": 120_000}) as d:
        yield d


def test_constrained_text_validates_and_a_bad_schema_is_a_400_before_queueing(board):
    with board.client(timeout=60) as c:
        for seed in range(4):  # room for the longest document: every output completes and validates
            r = c.generate("Data:", max_tokens=64, temperature=1.0, seed=seed, constraint=CONSTRAINT)
            assert r.finish_reason == "eos", (r.finish_reason, r.text)
            jsonschema.validate(json.loads(r.text), SCHEMA)
        for seed in range(4):  # cut short by max_tokens: what there is leads to an accepted document
            r = c.generate("Data:", max_tokens=12, temperature=1.0, seed=seed, constraint=CONSTRAINT)
            assert r.finish_reason == "length" and len(r.tokens) == 12, (r.finish_reason, r.text)
            assert any(d.startswith(r.text) for d in DOCUMENTS), r.text
        with pytest.raises(InvalidRequest) as info:
            c.generate("Data:", max_tokens=8, constraint={"kind": "regex", "body": "(\\d"})
        assert info.value.reason == "invalid_constraint" and "unclosed group" in str(info.value)
        with pytest.raises(InvalidRequest) as info:
            c.generate("Data:", max_tokens=8, constraint={"kind": "json_schema", "body": {"type": "objectx"}})
        assert "objectx" in str(info.value)
        # still serving, and the repeated schema compiled once
        r = c.generate("Data:", max_tokens=4, constraint={"kind": "regex", "body": "[0-9]{2}"})
        assert r.text.isdigit() and len(r.text) == 2 and r.finish_reason == "eos"
        st = c.stats()
    assert st["constraints"]["compiles"] >= 2 and st["constraints"]["hits"] >= 3 and st["constraints"]["rejected"] == 2


def test_a_resumed_stream_continues_inside_the_constraint(board):
    """A balancer resuming a broken stream sends the tokens so far as `continuation`: the worker replays them."""
    with board.client(timeout=60) as c:
        first = c.generate("Data:", max_tokens=5, seed=3, temperature=1.0, constraint=CONSTRAINT)
        assert first.finish_reason == "length"
        rest = c.generate("Data:", max_tokens=60, seed=3, temperature=1.0, constraint=CONSTRAINT,
                          continuation=first.tokens)
        whole = c.generate("Data:", max_tokens=60, seed=3, temperature=1.0, constraint=CONSTRAINT)
    assert whole.finish_reason == "eos"
    jsonschema.validate(json.loads(whole.text), SCHEMA)
    assert rest.finish_reason == "eos"
    jsonschema.validate(json.loads(first.text + rest.text), SCHEMA)
    assert first.tokens + rest.tokens == whole.tokens  # rebuilt state, same seed: the same output


def test_constrained_requests_requeued_when_their_worker_dies_complete_validly(board):
    d = board
    with d.client(timeout=60) as c:
        fault_free = [c.generate("Data:", max_tokens=60, seed=i, temperature=1.0, constraint=CONSTRAINT).tokens
                      for i in range(3)]
        victim = d.health()["chips"][0]["pid"]
        with frozen_then_killed(c, victim):
            results: list = [[] for _ in range(3)]
            streams = [c.stream("Data:", max_tokens=60, seed=i, temperature=1.0, constraint=CONSTRAINT,
                                result=results[i]) for i in range(3)]
        got = [[t for chunk in s for t in chunk] for s in streams]
        counters = c.stats()["scheduler"]["counters"]
    assert got == fault_free and counters.get("requeued", 0) > 0
    for toks in got:
        text = bytes(t for t in toks if t < 256).decode()
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_backend_that_samples_on_the_device_refuses_constraints_at_admission(daemon):
    d = daemon(backend="stub", chips=1)
    with d.client(timeout=30) as c:
        with pytest.raises(InvalidRequest) as info:
            c.generate([1, 2, 3], max_tokens=4, constraint={"kind": "json_object"})
        assert info.value.reason == "constraint_unsupported"
        assert len(c.generate([1, 2, 3], max_tokens=4).tokens) == 4
