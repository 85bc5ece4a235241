"""The wire side of LoRA adapters: which adapter a generate runs under, and the load_lora/unload_lora ops.

A generate names an adapter with `adapter: NAME`, or with `model: NAME`
(vLLM's convention: an adapter is a model id), or gets its tenant's
`default_adapter`; a tenant with `allowed_adapters` may name only those. The
request then runs on the adapter's base model, and its prefix-cache salt
carries the adapter's sha256, so its KV never meets KV computed under another
adapter or the base (the prefix cache, the host and disk tiers and the
prefill/decode hand-off all key on the salt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.daemon.auth import refused_unless_admin
from engine.daemon.lora_registry import Adapter, AdapterRefused
from ipc.schema import error_event

if TYPE_CHECKING:
    from engine.core.requests import GenerateParams
    from engine.daemon.frontend import Conn, Frontend
    from engine.daemon.generations import Generations

OPS = frozenset({"load_lora", "unload_lora"})


class AdapterRejected(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def pick_adapter(gens: "Generations", msg: dict) -> Adapter | None:
    """The adapter a validated generate runs under (None: the base model), which then runs on its base model.

    Raises AdapterRejected: 404 adapter_not_found, 403 adapter_forbidden."""
    lora = gens.lora
    name = msg.get("adapter")
    model = msg.get("model")
    if name is None and model is not None and lora.resolve(model) is not None:
        name = model  # `model: NAME` names an adapter
    tenant = gens.cfg.queues.tenant(msg.get("tenant", "default"))
    default = lora.resolve(tenant.default_adapter) if tenant.default_adapter else None
    if name is None and default is not None and model in (None, default.base):
        name = default.name  # the tenant's default adapter (while it is loaded; else the base model)
    if name is None:
        return None
    a = lora.resolve(name)
    if a is None:
        raise AdapterRejected(404, "adapter_not_found", f"adapter {name!r} is not loaded on this board")
    if tenant.allowed_adapters and name not in tenant.allowed_adapters:
        raise AdapterRejected(403, "adapter_forbidden", f"tenant {msg.get('tenant')!r} may not use adapter {name!r}")
    if model is not None and model not in (name, a.base):
        raise AdapterRejected(400, "conflicting_fields", f"adapter {name!r} adapts model {a.base!r}, not {model!r}")
    return a


def apply_adapter(params: "GenerateParams", a: Adapter) -> None:
    """The request's adapter number, and its KV salt (the adapter's content identity)."""
    params.adapter = a.number
    params.prefix_salt = f"{params.prefix_salt}\0lora:{a.sha256}"


def handle(gens: "Generations", fe: "Frontend", conn: "Conn", msg: dict, now: float) -> None:
    op, cid = msg["op"], msg["id"]
    if refused_unless_admin(fe, conn, cid, op):
        return
    name = msg["alias"]
    if op == "unload_lora":
        try:
            a = gens.lora.unload(name)
        except AdapterRefused as e:
            fe.error(conn, cid, e.code, e.reason, f"{op} {name!r}: {e.message}")
            return
        fe.reply(conn, cid, op, {"adapter": a.entry()})
        return

    def done(a: Adapter | None, e: AdapterRefused | None) -> None:
        if e is not None:
            ev = error_event(cid, e.code, e.reason, f"{op} {name!r}: {e.step}: {e.message}", False)
            ev["step"] = e.step
            fe.send(conn, ev)
        else:
            fe.reply(conn, cid, op, {"adapter": a.entry()})

    try:
        gens.lora.begin_load(name, msg["package"], msg.get("base") or "", done)
    except AdapterRefused as e:
        done(None, e)
