"""The daemon side of the model admin ops: load, unload, replace, rollback, models.

Admin only (ipc:// peers, or a tcp:// admin key: engine.daemon.auth.is_admin).
`models` (the list) is not admin-only; it is answered in engine/daemon/ops.py.
Each op answers once, when its work is done: `load`/`replace`/`rollback`
when the new generation is Ready (or with an error naming the failed step),
`unload` when the generation is Unloaded (or Recovering when jobs were still
in flight at the deadline). The loop goes on serving meanwhile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.model_table import GenerationRecord, LifecycleError
from engine.daemon.auth import refused_unless_admin
from ipc.schema import error_event

if TYPE_CHECKING:
    from engine.daemon.frontend import Conn, Frontend
    from engine.daemon.generations import Generations
    from engine.daemon.models.load_job import LoadJob

OPS = frozenset({"load", "unload", "replace", "rollback"})  # `models` is open to all (engine/daemon/ops.py)


def handle(gens: "Generations", fe: "Frontend", conn: "Conn", msg: dict, now: float) -> None:
    op, cid = msg["op"], msg["id"]
    if refused_unless_admin(fe, conn, cid, op):
        return
    alias = msg["alias"]
    deadline_s = msg.get("deadline_s")
    drain_s = gens.cfg.server.drain_timeout_s if deadline_s is None else float(deadline_s)
    try:
        if op == "unload":
            gid = gens.models.published.get(alias)
            if gid is None:
                raise LifecycleError(404, "model_not_found", f"{alias!r} is not loaded here")
            if alias in gens.models.busy:
                raise LifecycleError(409, "busy", f"{alias!r}: another admin op is still running on it")
            rec = gens.models.generations[gid]
            gens.begin_unload(rec, now=now, deadline_s=drain_s,
                              waiter=lambda r: fe.reply(conn, cid, "unload", {"model": gens.entry(r)}))
            return
        if op == "rollback":  # the path it had when it was published (verified again like any load)
            package, path = gens.models.rollback_package(alias)
        else:
            package, path = msg["package"], None
        previous = gens.models.published.get(alias)

        def done(job: "LoadJob") -> None:
            if job.error is not None:
                e = job.error
                ev = error_event(cid, e.code, e.reason, f"{op} {alias!r}: {e.step}: {e.message}", False)
                ev["step"] = e.step
                fe.send(conn, ev)
                return
            body = {"model": gens.entry(job.rec)}
            if op != "load" and previous is not None:
                prev: GenerationRecord | None = gens.models.generations.get(previous)
                body["previous"] = gens.entry(prev) if prev is not None else gens.retired_entries.get(previous)
            fe.reply(conn, cid, op, body)

        gens.begin_load(alias, package, op, now, done, deadline_s=drain_s, package_path=path)
    except LifecycleError as e:
        fe.error(conn, cid, e.code, e.reason, f"{op}: {e.message}")
