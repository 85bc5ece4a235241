"""Checks of a request's lifetime: cancel, duplicate and per-connection ids, deadlines, 404s, overload.

Each check returns a short note on success and raises `Fail` (or `Skip`)
otherwise.
"""

from __future__ import annotations

from tools.conformance.checks_generate import SETTLE_S, run_one
from tools.conformance.env import Env, gen, op
from tools.conformance.shapes import Fail, Skip, error_event, expect, generate_result, short


def _first_tokens(c, rid: str) -> list[dict]:
    """Events of `rid` up to and including its first tokens event (or its terminal event)."""
    evs = []
    while True:
        ev = c.next_event()
        if ev.get("id") != rid:
            raise Fail(f"an event for an id not sent on this connection: {short(ev)}")
        evs.append(ev)
        if ev["ev"] in ("tokens", "done", "error"):
            return evs


def check_cancel(env: Env) -> str:
    """cancel (twice, and of an unknown id) has no reply; the request ends with done/cancelled."""
    c = env.conn()
    p = env.target.prompt(7)
    n = env.target.long_max_tokens(len(p))
    rid = env.rid()
    c.send(gen(rid, p, max_tokens=n, ignore_eos=True))
    evs = _first_tokens(c, rid)
    c.send(op("cancel", rid))
    c.send(op("cancel", rid))
    c.send(op("cancel", env.rid("unknown")))
    evs += c.collect([rid])[rid]
    r = generate_result(evs, stream=True, text=env.target.text, daemon=env.daemon)
    reason = r["done"]["finish_reason"]
    probe = env.rid("health")
    ev = c.request(op("health", probe))  # in order on one connection: a cancel's reply would come first
    expect(ev.get("id") == probe and ev["ev"] == "health", f"a cancel was answered: {short(ev)}")
    late = c.quiet(SETTLE_S)
    expect(not late, f"events after the health reply: {short(late)}")
    if reason == "cancelled":
        return f"cancelled after {len(r['tokens'])} of {n} tokens"
    expect(reason == "length" and len(r["tokens"]) == n,
           f"after a cancel the request must end cancelled (or naturally): {reason}, {len(r['tokens'])} tokens")
    return f"finished all {n} tokens before the cancel arrived (allowed; cancellation not exercised)"


def check_cancel_finished(env: Env) -> str:
    """Cancelling a request that already finished is a no-op with no reply."""
    c = env.conn()
    rid = env.rid()
    run_one(env, gen(rid, env.target.prompt(8), max_tokens=2), conn=c)
    c.send(op("cancel", rid))
    probe = env.rid("health")
    ev = c.request(op("health", probe))
    expect(ev.get("id") == probe and ev["ev"] == "health", f"a cancel of a finished id was answered: {short(ev)}")
    return "no reply"


def check_duplicate_id(env: Env) -> str:
    """A second generate with an id in flight gets 400 duplicate_id; the first continues."""
    c = env.conn()
    p = env.target.prompt(9)
    n = env.target.long_max_tokens(len(p))
    rid = env.rid()
    first = gen(rid, p, max_tokens=n, ignore_eos=True)
    c.send(first)
    evs = _first_tokens(c, rid)
    if evs[-1]["ev"] != "tokens":
        raise Fail(f"the long request ended at once: {short(evs[-1])}")
    c.send(gen(rid, p, max_tokens=2))
    errors = []
    while True:  # the duplicate's error comes among the first request's tokens
        ev = c.next_event()
        if ev["ev"] == "error":
            errors.append(ev)
            break
        evs.append(ev)
        if ev["ev"] == "done":
            break
    expect(len(errors) == 1, f"no duplicate_id error before the first request ended ({n} tokens)")
    error_event(errors[0], 400, "duplicate_id", rid)
    expect(errors[0]["retryable"] is False, f"400 duplicate_id must not be retryable: {short(errors[0])}")
    if evs[-1]["ev"] != "done":
        c.send(op("cancel", rid))
        evs += c.collect([rid])[rid]
    r = generate_result(evs, stream=True, text=env.target.text)
    expect(r["done"]["finish_reason"] in ("cancelled", "length"), f"the first request did not continue: {r['done']}")
    return "duplicate refused, first continued to its own end"


def check_ids_per_connection(env: Env) -> str:
    """The same id on two connections is two requests."""
    a, b = env.conn(), env.conn()
    rid = env.rid()
    p = env.target.prompt(10)
    a.send(gen(rid, p, max_tokens=3, ignore_eos=True))
    b.send(gen(rid, p, max_tokens=3, ignore_eos=True))
    ra = generate_result(a.collect([rid])[rid], stream=True, text=env.target.text)
    rb = generate_result(b.collect([rid])[rid], stream=True, text=env.target.text)
    expect(len(ra["tokens"]) == len(rb["tokens"]) == 3, "both requests must run to their 3 tokens")
    return "both served"


def check_deadline(env: Env) -> str:
    """A request that cannot finish within deadline_ms ends with error 504."""
    c = env.conn()
    p = env.target.prompt(11)
    n = env.target.long_max_tokens(len(p))
    rid = env.rid()
    c.send(gen(rid, p, max_tokens=n, ignore_eos=True, deadline_ms=1))
    evs = c.collect([rid])[rid]
    last = evs[-1]
    expect(all(e["ev"] == "tokens" for e in evs[:-1]), f"only tokens events may precede the error: {evs[:-1][:3]}")
    expect(last["ev"] == "error", f"deadline_ms 1 for {n} tokens should end in 504, got {short(last)}")
    error_event(last, 504, None, rid)
    return f"504 {last['reason']}"


def check_model_not_found(env: Env) -> str:
    c = env.conn()
    rid = env.rid()
    c.send(gen(rid, env.target.prompt(12), model="conformance-no-such-model", max_tokens=2))
    error_event(c.collect([rid])[rid][-1], 404, "model_not_found", rid)
    return "404 model_not_found"


def check_second_model(env: Env) -> str:
    alias = env.opts.second_model
    if not alias:
        raise Skip("needs --second-model ALIAS (an alias the endpoint serves beside the default)")
    c = env.conn()
    rid = env.rid()
    listed = c.request(op("models", rid))
    aliases = [m.get("alias") for m in listed.get("models") or []]
    expect(alias in aliases, f"models does not list {alias!r}: {aliases}")
    r = run_one(env, gen(env.rid(), env.target.prompt(13), model=alias, max_tokens=3, ignore_eos=True))
    if env.daemon:
        gens = [m.get("generation") for m in listed["models"] if m.get("alias") == alias]
        expect(r["done"].get("generation") in gens,
               f"done.generation {r['done'].get('generation')!r} is not one models lists for {alias}: {gens}")
    return f"{alias} served"


def check_overload(env: Env) -> str:
    """A burst larger than the waiting room gets retryable 429s; every request still ends exactly once."""
    n = env.opts.overload
    if not n:
        raise Skip("needs --overload N (a burst that overflows the endpoint's admission.max_waiting_requests)")
    c = env.conn()
    p = env.target.prompt(14)
    long_n = env.target.long_max_tokens(len(p))
    ids = []
    for i in range(n):
        rid = env.rid(str(i))
        c.send(gen(rid, p, max_tokens=long_n, ignore_eos=True))
        ids.append(rid)
    got: dict[str, list[dict]] = {i: [] for i in ids}
    rejected = []
    ended: set[str] = set()
    cancelled = False
    while len(ended) < len(ids):
        ev = c.next_event()
        rid = str(ev.get("id"))
        expect(rid in got, f"an event for an id not sent: {short(ev)}")
        got[rid].append(ev)
        if ev["ev"] in ("done", "error"):
            ended.add(rid)
            if ev["ev"] == "error" and ev.get("code") == 429:
                rejected.append(ev)
        # once a 429 came, or every request has been heard from, the admitted ones are not needed any more
        if not cancelled and (rejected or all(got[i] for i in ids)):
            cancelled = True
            for other in ids:
                c.send(op("cancel", other))
    for rid in ids:
        evs = got[rid]
        if evs[-1]["ev"] == "error":
            expect(len([e for e in evs if e["ev"] in ("done", "error")]) == 1, f"{rid}: two terminal events")
            error_event(evs[-1])
        else:
            generate_result(evs, stream=True, text=env.target.text)
    expect(bool(rejected), f"a burst of {n} long requests got no 429 (is --overload above the waiting room?)")
    for ev in rejected:
        error_event(ev, 429)
        expect(ev["retryable"] is True, f"429 must be retryable: {short(ev)}")
    late = c.quiet(SETTLE_S)
    expect(not late, f"events after every request ended: {short(late)}")
    return f"{len(rejected)} of {n} got 429 {sorted({e['reason'] for e in rejected})}"
