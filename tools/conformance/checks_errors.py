"""The 400 table of protocol.md ("Errors"): one check per reason, each followed by a request that still works.

Every case is a message the document says is malformed, sent as raw bytes
where the malformation is below JSON (bad JSON, oversized). The error must
be a 400 with that reason, `retryable: false`, the request's `id` when it
could be read (`null` when not), and the endpoint must keep serving.
"""

from __future__ import annotations

import orjson

from tools.conformance.env import Env, gen, op
from tools.conformance.shapes import error_event, expect, short


def _after(env: Env, c) -> None:
    """The endpoint keeps serving on the same connection."""
    probe = env.rid("alive")
    ev = c.request(op("health", probe))
    expect(ev["ev"] == "health" and ev.get("id") == probe, f"no health reply after the error: {short(ev)}")


def _one(env: Env, data: bytes | dict, reason: str, rid, names: str | None = None) -> str:
    c = env.conn()
    ev = c.request(data)
    error_event(ev, 400, reason, rid)
    expect(ev["retryable"] is False, f"a malformed message is not retryable: {short(ev)}")
    if names:
        expect(names in ev["message"], f"the message must name the field {names!r}: {ev['message']!r}")
    _after(env, c)
    return ev["message"][:70]


def _cases(env: Env) -> dict[str, list[tuple]]:
    """reason -> [(message, expected id, field the message must name)]."""
    p = env.target.prompt(20)
    r = env.rid
    cases: dict[str, list[tuple]] = {
        "bad_json": [(b"{this is not json", None, None), (b"\xff\xfe\x00", None, None),
                     (b'{"v":1,"op":"generate","id":"x","prompt":[1],"temperature":NaN}', None, None)],
        "not_an_object": [(b"[1, 2, 3]", None, None), (b'"generate"', None, None)],
        "missing_field": [],
        "conflicting_fields": [],
        "bad_version": [],
        "unknown_op": [],
        "unknown_field": [],
        "bad_type": [],
        "out_of_range": [],
    }
    ids = {k: r(k) for k in ("mf", "mv", "cf", "bv", "bv2", "bv3", "uo", "uf", "bt1", "bt2", "bt3", "bt4",
                               "or1", "or2", "or3", "or4", "or5", "or6", "or7", "or8", "or9", "or10")}
    cases["missing_field"] = [(gen(ids["mf"], max_tokens=2), ids["mf"], None),
                              (orjson.dumps({"op": "health", "id": ids["mv"]}), ids["mv"], None),
                              (orjson.dumps({"v": 1, "op": "health"}), None, None)]
    cases["conflicting_fields"] = [(gen(ids["cf"], p, text="hi", max_tokens=2), ids["cf"], None)]
    cases["bad_version"] = [(dict(gen(ids["bv"], p), v=2), ids["bv"], None),
                            (dict(gen(ids["bv2"], p), v=True), ids["bv2"], None),
                            (dict(gen(ids["bv3"], p), v=1.0), ids["bv3"], None)]
    cases["unknown_op"] = [(op("conformance_no_such_op", ids["uo"]), ids["uo"], None)]
    cases["unknown_field"] = [(gen(ids["uf"], p, max_token=3), ids["uf"], "max_token")]
    cases["bad_type"] = [(gen(ids["bt1"], p, max_tokens="5"), ids["bt1"], "max_tokens"),
                         (gen(ids["bt2"], p, max_tokens=True), ids["bt2"], "max_tokens"),
                         (gen(ids["bt3"], p, max_tokens=4.0), ids["bt3"], "max_tokens"),
                         (gen(ids["bt4"], p, stream=1), ids["bt4"], "stream")]
    cases["out_of_range"] = [(gen(ids["or1"], p, max_tokens=0), ids["or1"], "max_tokens"),
                             (gen(ids["or2"], p, top_p=0.0), ids["or2"], "top_p"),
                             (gen(ids["or3"], [], max_tokens=1), ids["or3"], "prompt"),
                             (gen(ids["or4"], p, seed=-1), ids["or4"], "seed"),
                             (gen(ids["or5"], p, tenant="no spaces"), ids["or5"], "tenant"),
                             (gen(ids["or6"], p, priority=101), ids["or6"], "priority"),
                             (gen(ids["or7"], p, deadline_ms=86400001), ids["or7"], "deadline_ms"),
                             (gen(ids["or8"], p, stop=["x"] * 17), ids["or8"], "stop"),
                             (gen(ids["or9"], p, speculative="fast"), ids["or9"], "speculative"),
                             (op("health", "x" * 129), None, "id")]
    if env.target.text:  # the daemon's own check: a text that encodes to no tokens
        cases["out_of_range"].append((gen(ids["or10"], None, text=""), ids["or10"], "text"))
    return cases


def make_reason_check(reason: str):
    def check(env: Env) -> str:
        notes = []
        for data, rid, names in _cases(env)[reason]:
            notes.append(_one(env, data, reason, rid, names))
        return f"{len(notes)} case(s); e.g. {notes[0]!r}"

    check.__doc__ = f"Malformed messages of the `{reason}` kind get 400 {reason}."
    return check


REASONS = ("bad_json", "not_an_object", "missing_field", "conflicting_fields", "bad_version", "unknown_op",
           "unknown_field", "bad_type", "out_of_range")


def check_too_large(env: Env) -> str:
    """A message over server.max_message_bytes (below 16x it) gets 400 too_large with its id, unparsed."""
    limit = env.opts.max_message_bytes
    rid = env.rid()
    head = orjson.dumps(gen(rid, None))[:-1]  # {"v":1,"op":"generate","id":"..."
    body = b',"prompt":[' + b",".join([b"1"] * (limit // 2 + 1024)) + b"]}"
    data = head + body
    expect(len(data) > limit and len(data) < 16 * limit, "internal: the oversized message has the wrong size")
    c = env.conn()
    ev = c.request(data)
    error_event(ev, 400, "too_large", rid)
    _after(env, c)
    return f"{len(data)} bytes refused (limit {limit})"


def check_per_model(env: Env) -> str:
    """The scheduler's per-model checks answer 400 in the same shape (reasons as observability.md names them)."""
    c = env.conn()
    notes = []
    for tag, msg, reason in (
            ("vocab", gen(env.rid("vocab"), [1, env.target.vocab_size], max_tokens=2), "token_out_of_range"),
            ("ctx", gen(env.rid("ctx"), [1, 2], max_tokens=env.target.max_seq), "context_too_long")):
        c.send(msg)
        evs = c.collect([msg["id"]])[msg["id"]]
        expect(all(e["ev"] == "tokens" for e in evs[:-1]), f"{tag}: only tokens may precede the error: "
                                                          f"{[e['ev'] for e in evs]}")
        error_event(evs[-1], 400, reason, msg["id"])
        expect(evs[-1]["retryable"] is False, f"{reason} is not retryable: {short(evs[-1])}")
        # the document does not say when: a board refuses at once, a prefill/decode pair after the prefill
        # leg's token (its decode leg is the one refused)
        notes.append(reason + (f" after {len(evs) - 1} tokens event(s)" if len(evs) > 1 else ""))
    _after(env, c)
    return ", ".join(notes)
