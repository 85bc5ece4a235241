"""What each wire op does at a balancer (the daemon's op table, answered by routing instead of a scheduler).

`generate`/`cancel` go to the balancer core; `health` is answered from the
backends' last heartbeats; `stats`/`models` are fanned out to the backends
and aggregated; `drain`/`resume` (admin) act on the balancer itself (with
`timeout_ms`, what is still in flight then ends with 503 `shutdown`; without
it the balancer, having no drain budget of its own, lets it finish), or with
`backend` on one backend (no new requests there, in-flight ones finish).
The model lifecycle ops (`load`, `unload`, `replace`, `rollback`) are not
relayed: each names a package inside one board's model root and changes that
board's generations, so an operator sends them to each daemon in turn and
the balancer answers them 501 `not_implemented` (docs/balancer.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from engine.daemon.auth import is_admin, tenant_for

if TYPE_CHECKING:
    from engine.balancer.core import BalancerCore
    from engine.daemon.frontend import Conn, Frontend


class BalancerPorts(Protocol):
    """What an op reaches of the balancer shell: its frontend, its core and its request ids."""

    frontend: "Frontend"
    core: "BalancerCore"

    def next_request_id(self) -> int: ...

# Board-level model management: valid on the wire, answered 501 here (see the module docstring).
NOT_IMPLEMENTED_OPS = frozenset({"load", "unload", "replace", "rollback", "load_lora", "unload_lora"})


def handle(bal: BalancerPorts, conn: "Conn", msg: dict, now: float) -> list:
    op = msg["op"]
    cid = msg["id"]
    fe = bal.frontend
    core = bal.core
    if op == "generate":
        rid = bal.next_request_id()
        if not fe.open(rid, conn, cid, bool(msg["stream"]), bool(msg["logprobs"] or msg.get("top_logprobs"))):
            fe.error(conn, cid, 400, "duplicate_id", f"request id {cid!r} is already in flight on this connection")
            return []
        msg["tenant"] = tenant_for(conn, msg["tenant"])
        return core.submit(rid, msg, now)
    if op == "cancel":
        rid = fe.lookup(conn, cid)
        return [] if rid is None else core.cancel(rid, now)
    if op == "health":
        fe.reply(conn, cid, "health", {**core.health(now), "pid": os.getpid()})
        return []
    if op in ("stats", "models"):
        return core.fanout((conn, cid), op, now)
    if op in ("drain", "resume"):
        if not is_admin(conn):
            fe.error(conn, cid, 403, "forbidden", f"{op} needs an admin connection (ipc:// or an admin key)")
            return []
        target = msg.get("backend")
        timeout_ms = msg.get("timeout_ms") if op == "drain" else None  # checked by the wire schema
        if target is None and op == "drain":
            core.drain(now, None if timeout_ms is None else timeout_ms / 1000.0)
            fe.reply(conn, cid, op, {"accepting": core.accepting,
                                     **({} if timeout_ms is None else {"timeout_ms": timeout_ms})})
        elif target is None:
            core.resume()
            fe.reply(conn, cid, op, {"accepting": core.accepting})
        elif core.set_drained(target, op == "drain"):
            fe.reply(conn, cid, op, {"backend": target, "drained": op == "drain"})
        else:
            fe.error(conn, cid, 404, "backend_not_found", f"{target!r} is not a backend of this balancer "
                                                          f"(see health.balancer.backends)")
        return []
    if op in NOT_IMPLEMENTED_OPS:
        fe.error(conn, cid, 501, "not_implemented", f"{op}: send model management to the daemons directly")
        return []
    fe.error(conn, cid, 400, "unknown_op", f"op {op!r} is not served here")
    return []
