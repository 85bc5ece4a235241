"""Checks of the non-generate ops: health, stats, models, hello, and the admin ops drain/resume.

The documented keys differ between a board daemon (protocol.md) and a
balancer (balancer.md, "Health"); the check picks the list by the
endpoint's kind.
"""

from __future__ import annotations

from tools.conformance.checks_generate import run_concurrent_streams, run_one
from tools.conformance.env import Env, gen, op
from tools.conformance.shapes import Fail, Skip, error_event, expect, has_keys, short

DAEMON_HEALTH = ("ok", "accepting", "loop_ok", "loop_lag_ms", "chips_up", "chips", "model", "models", "board",
                 "pid", "uptime_s", "active_requests", "load")
BALANCER_HEALTH = ("ok", "accepting", "chips_up", "active_requests", "load", "model", "backends_up",
                   "backends_total", "balancer")
CHIP_KEYS = ("chip", "state", "pid", "restarts_10min", "restarts_total", "last_failure", "backlog", "device_s",
             "worker_s")
CHIP_STATES = ("starting", "up", "restarting", "out")
MODEL_KEYS = ("alias", "backend", "vocab_size", "max_seq", "eos_ids", "profiles", "sha256", "text")
LOAD_KEYS = ("waiting", "running", "kv_used")
BACKEND_KEYS = ("state", "reason", "routable", "drained", "removed", "load", "inflight", "stale", "heartbeat_age_s",
                "reported_load")
BACKEND_STATES = ("unknown", "up", "out", "half_open")
DAEMON_STATS = ("scheduler", "metrics", "frontend", "daemon", "chips", "models", "uptime_s")
FRONTEND_KEYS = ("messages_in", "protocol_errors", "requests", "events_out", "tokens_out", "duplicate_ids",
                 "blocked_clients", "dropped_clients", "dropped_events")
DAEMON_KEYS = ("jobs_submitted", "ring_full", "results", "chip_failures", "worker_restarts", "cancelled_dead_clients",
               "active_requests", "loop_turns", "loop_max_turn_ms")
BALANCER_STATS = ("balancer", "backends", "total")
ENTRY_KEYS = ("alias", "generation", "state", "package", "sha256", "default", "active_requests", "counters", "error",
              "backend", "vocab_size", "max_seq", "eos_ids", "profiles", "text")
MODEL_STATES = ("unloaded", "validating", "configuring", "warming", "ready", "draining", "unloading", "recovering",
                "failed")


def _reply(env: Env, name: str, **fields) -> dict:
    c = env.conn()
    rid = env.rid()
    ev = c.request(op(name, rid, **fields))
    if ev["ev"] == "error":
        error_event(ev)
        raise Fail(f"{name} answered {ev['code']} {ev['reason']}: {ev['message']}")
    expect(ev["ev"] == name and ev.get("id") == rid, f"{name} must be answered by a {name} event with its id: "
                                                     f"{short(ev)}")
    return ev


def check_health(env: Env) -> str:
    h = _reply(env, "health")
    if env.daemon:
        has_keys(h, DAEMON_HEALTH, "health")
        expect(isinstance(h["chips"], list) and bool(h["chips"]), f"health.chips must list the chips: {h['chips']}")
        for ch in h["chips"]:
            has_keys(ch, CHIP_KEYS, "health.chips[]")
            expect(ch["state"] in CHIP_STATES, f"chip state {ch['state']!r} not one of {CHIP_STATES}")
        expect(isinstance(h["models"], list), f"health.models must be a list of aliases: {h['models']}")
        expect(isinstance(h["loop_ok"], bool), f"health.loop_ok must be a bool: {h['loop_ok']!r}")
    else:
        has_keys(h, BALANCER_HEALTH, "health")
        backends = (h["balancer"] or {}).get("backends")
        expect(isinstance(backends, (dict, list)) and bool(backends), f"health.balancer.backends: {short(backends)}")
        for b in (backends.values() if isinstance(backends, dict) else backends):
            has_keys(b, BACKEND_KEYS, "health.balancer.backends[]")
            expect(b["state"] in BACKEND_STATES, f"backend state {b['state']!r} not one of {BACKEND_STATES}")
    for k in ("ok", "accepting"):
        expect(isinstance(h[k], bool), f"health.{k} must be a bool: {h[k]!r}")
    expect(isinstance(h["chips_up"], int), f"health.chips_up must be an int: {h['chips_up']!r}")
    has_keys(h["model"], MODEL_KEYS, "health.model")
    has_keys(h["load"], LOAD_KEYS, "health.load")
    c = env.conn()
    rid = env.rid("field")
    error_event(c.request(op("health", rid, verbose=True)), 400, "unknown_field", rid)  # "no fields"
    return f"{env.target.kind}: ok={h['ok']}, chips_up={h['chips_up']}"


def check_stats(env: Env) -> str:
    s = _reply(env, "stats")
    if env.daemon:
        has_keys(s, DAEMON_STATS, "stats")
        has_keys(s["frontend"], FRONTEND_KEYS, "stats.frontend")
        has_keys(s["daemon"], DAEMON_KEYS, "stats.daemon")
        expect(isinstance(s["models"], list) and bool(s["models"]), f"stats.models: {short(s['models'])}")
        for m in s["models"]:
            has_keys(m, ENTRY_KEYS + ("scheduler", "chips"), "stats.models[]")
    else:
        has_keys(s, BALANCER_STATS, "stats")
        has_keys(s["balancer"], ("counters", "routed", "active_requests", "policy"), "stats.balancer")
    return f"{len(s)} top-level keys"


def check_models(env: Env) -> str:
    m = _reply(env, "models")
    entries = m.get("models")
    expect(isinstance(entries, list) and bool(entries), f"models.models must list the served models: {short(m)}")
    for e in entries:
        has_keys(e, ENTRY_KEYS, "models.models[]")
        expect(e["state"] in MODEL_STATES, f"model state {e['state']!r} not one of {MODEL_STATES}")
        expect(isinstance(e["default"], bool), f"ENTRY.default must be a bool: {e['default']!r}")
    aliases = [e["alias"] for e in entries]
    expect((env.target.health.get("model") or {}).get("alias") in aliases,
           f"the default model of health is not in models: {aliases}")
    with_auth = _reply(env, "models", auth=None)  # models takes `auth` like the admin ops, needing no rights
    expect(isinstance(with_auth.get("models"), list), f"models with auth: null: {short(with_auth)}")
    return f"{len(entries)} generation(s): {aliases}"


def check_hello(env: Env) -> str:
    """hello lists what it grants (unknown names ignored); batched messages are then valid events per frame."""
    c = env.conn()
    rid = env.rid()
    ev = c.request(op("hello", rid, capabilities=["batched_events", "conformance_unknown_capability"]))
    if ev["ev"] == "error" and ev.get("reason") == "unknown_op":
        raise Fail("the endpoint predates hello (400 unknown_op); v1 servers answer it")
    expect(ev["ev"] == "hello" and ev.get("id") == rid, f"hello must be answered by a hello event: {short(ev)}")
    granted = ev.get("capabilities")
    expect(isinstance(granted, list), f"hello.capabilities must be a list: {short(ev)}")
    expect("conformance_unknown_capability" not in granted, f"an unknown capability was granted: {granted}")
    expect(set(granted) <= {"batched_events"}, f"granted capabilities that were not asked for: {granted}")
    c.batched = "batched_events" in granted
    run_concurrent_streams(env, c, 300)
    batched = c.multi_frame_messages
    again = env.rid("again")
    ev = c.request(op("hello", again, capabilities=[]))  # a later hello replaces the set: back to one per message
    expect(ev["ev"] == "hello" and ev.get("id") == again and ev.get("capabilities") == [],
           f"hello with no capabilities must grant none: {short(ev)}")
    c.batched = False
    run_concurrent_streams(env, c, 320, n=8, context="after a hello that granted nothing: ")
    over = env.conn()
    bad = over.request(op("hello", env.rid("17"), capabilities=[f"cap{i}" for i in range(17)]))
    error_event(bad, 400)
    return (f"granted {granted}; {batched} messages batched; hello [] undoes it; "
            f"17 names: 400 {bad['reason']}")


def check_forbidden(env: Env) -> str:
    """Admin ops from a client without admin rights get 403 forbidden."""
    if not env.opts.admin_denied:
        raise Skip("needs --admin-denied (the endpoint denies this client admin ops: tcp:// without an admin key)")
    c = env.conn()
    notes = []
    for name in ("drain", "resume"):
        rid = env.rid(name)
        ev = c.request(op(name, rid))
        if ev["ev"] == name:  # it was granted after all: undo a drain before failing
            c.request(op("resume", env.rid("undo")))
            raise Fail(f"{name} was granted; run without --admin-denied (or with --admin) against this endpoint")
        error_event(ev, 403, "forbidden", rid)
        notes.append(name)
    return f"403 forbidden for {', '.join(notes)}"


def check_drain_resume(env: Env) -> str:
    """drain stops admission (503 draining, retryable); resume admits again. Each answered by its own event."""
    if not env.opts.admin:
        raise Skip("needs --admin (the endpoint grants this client admin ops: an ipc:// socket or an admin key)")
    c = env.conn()
    rid = env.rid("drain")
    ev = c.request(op("drain", rid, timeout_ms=None))
    if ev["ev"] == "error":
        error_event(ev)
        raise Fail(f"drain answered {ev['code']} {ev['reason']}: {ev['message']}")
    expect(ev["ev"] == "drain" and ev.get("id") == rid, f"drain must be answered by a drain event: {short(ev)}")
    try:
        g = env.rid("refused")
        c.send(gen(g, env.target.prompt(30), max_tokens=2))
        refused = c.collect([g])[g]
        expect(len(refused) == 1, f"a drained endpoint must refuse at once: {[e['ev'] for e in refused]}")
        error_event(refused[0], 503, "draining", g)
        expect(refused[0]["retryable"] is True, f"503 draining must be retryable: {short(refused[0])}")
    finally:
        rid = env.rid("resume")
        ev = c.request(op("resume", rid))
    expect(ev["ev"] == "resume" and ev.get("id") == rid, f"resume must be answered by a resume event: {short(ev)}")
    run_one(env, gen(env.rid("after"), env.target.prompt(31), max_tokens=2))
    note = "drain -> 503 draining -> resume -> served"
    if env.daemon:
        bid = env.rid("backend")
        ev = c.request(op("drain", bid, backend="tcp://127.0.0.1:1"))
        if ev["ev"] == "drain":
            c.request(op("resume", env.rid("undo")))
        error_event(ev, 404, "backend_not_found", bid)
        note += "; drain with backend at a daemon: 404 backend_not_found"
    return note


def check_model_lifecycle(env: Env) -> str:
    """load, models, generate on the new alias, the lifecycle errors, unload: each answered as documented."""
    if not env.opts.package:
        raise Skip("needs --package PATH (a model package inside the endpoint's model root) and --admin")
    if not env.opts.admin:
        raise Skip("needs --admin (load and unload are admin ops)")
    c = env.conn()
    alias = f"conformance-{env.rid()[-24:].replace('_', '-')}"[:64]
    lid = env.rid("load")
    ev = c.request(op("load", lid, alias=alias, package=env.opts.package), timeout_s=max(env.opts.timeout_s, 120))
    if ev["ev"] == "error":
        error_event(ev)
        raise Fail(f"load of {env.opts.package!r} failed: {ev['code']} {ev['reason']} (step {ev.get('step')}): "
                   f"{ev['message']}")
    expect(ev["ev"] == "load" and ev.get("id") == lid, f"load must be answered by a load event: {short(ev)}")
    entry = ev.get("model")
    has_keys(entry, ENTRY_KEYS, "load.model")
    expect(entry["alias"] == alias and entry["state"] == "ready", f"load.model: {short(entry)}")
    try:
        listed = _reply(env, "models")["models"]
        expect(any(m["alias"] == alias and m["generation"] == entry["generation"] for m in listed),
               f"models does not list {alias} generation {entry['generation']}")
        r = run_one(env, gen(env.rid("on"), env.target.prompt(40), model=alias, max_tokens=3, ignore_eos=True))
        if env.daemon:
            expect(r["done"].get("generation") == entry["generation"],
                   f"done.generation {r['done'].get('generation')!r}, the loaded one is {entry['generation']!r}")
        again = env.rid("again")
        error_event(c.request(op("load", again, alias=alias, package=env.opts.package)), 409, "already_loaded", again)
        nop = env.rid("rollback")
        error_event(c.request(op("rollback", nop, alias=alias)), 409, "no_previous", nop)
        out = env.rid("escape")
        ev = c.request(op("load", out, alias=alias + "-x", package="../conformance-outside"))
        error_event(ev, 400, "package_rejected", out)
        expect(ev.get("step") == "resolve", f"a package outside the model root fails at step resolve: {short(ev)}")
    finally:
        uid = env.rid("unload")
        ev = c.request(op("unload", uid, alias=alias, deadline_s=30), timeout_s=max(env.opts.timeout_s, 120))
    expect(ev["ev"] == "unload" and ev.get("id") == uid, f"unload must be answered by an unload event: {short(ev)}")
    expect(ev["model"]["state"] in ("unloaded", "recovering"), f"unload.model.state: {ev['model']['state']}")
    gone = env.rid("gone")
    c.send(gen(gone, env.target.prompt(41), model=alias, max_tokens=2))
    error_event(c.collect([gone])[gone][-1], 404, "model_not_found", gone)
    nid = env.rid("never")
    error_event(c.request(op("unload", nid, alias=alias + "-never")), 404, "model_not_found", nid)
    return (f"load -> ready generation {entry['generation']}, served; 409 already_loaded, 409 no_previous, "
            "400 package_rejected (resolve); unload; 404 after")
