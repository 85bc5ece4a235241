"""Which backends can serve the model and LoRA adapter a request names, from what their heartbeats report.

A board's `health` reports its default model (`model.alias`) and its loaded
adapters (`adapters`: name -> the alias it adapts); a balancer's reports the
union of its backends'. A request names an adapter with `adapter`, or with
`model` when that name is an adapter (an adapter is a model id, as on a
board). It goes only to backends reporting that adapter, and is sent on
unchanged: a board takes either form. A backend whose heartbeat carries no
`adapters` (a board of an older version, or none seen yet) may hold any:
an explicit `adapter` goes there when no backend is known to hold it, which
is what a balancer did before it knew adapters.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.balancer.backend_state import Backend


def alias_of(b: Backend) -> str | None:
    m = b.reported.get("model")
    return m.get("alias") if isinstance(m, dict) else None


def adapters_of(b: Backend) -> dict[str, str] | None:
    """The backend's adapters (name -> base alias) as its last heartbeat reported them; None: not reported."""
    a = b.reported.get("adapters")
    return a if isinstance(a, dict) else None


def known_adapters(backends: Iterable[Backend]) -> dict[str, str]:
    """Every adapter some of `backends` report, with the base alias it adapts (one of them, if they differ)."""
    out: dict[str, str] = {}
    for b in backends:
        for name, base in (adapters_of(b) or {}).items():
            if isinstance(name, str) and isinstance(base, str):
                out.setdefault(name, base)
    return out


def requested_adapter(msg: dict, backends: list[Backend]) -> tuple[str | None, bool]:
    """(adapter, explicit): the adapter the request names, and whether it named it in `adapter`."""
    adapter = msg.get("adapter")
    if isinstance(adapter, str):
        return adapter, True
    model = msg.get("model")
    if isinstance(model, str) and model not in {alias_of(b) for b in backends} \
            and model in known_adapters(backends):
        return model, False
    return None, False


def matching(cands: list[Backend], msg: dict, everyone: list[Backend]) -> list[Backend]:
    """The candidates that serve the request's model and adapter (`everyone`: the backends not removed)."""
    model = msg.get("model")
    adapter, explicit = requested_adapter(msg, everyone)
    if adapter is None:
        return cands if model is None else [b for b in cands if alias_of(b) in (None, model)]
    if model is not None and model != adapter:  # the adapter's base, named beside it
        cands = [b for b in cands if alias_of(b) in (None, model)]
    holders = [b for b in cands if adapter in (adapters_of(b) or {})]
    if holders or not explicit:
        return holders
    return [b for b in cands if adapters_of(b) is None]


def not_served(msg: dict, everyone: list[Backend]) -> tuple[str, str] | None:
    """(reason, message) of the 404 for a model or adapter no backend serves; None: some backend may serve it
    (the request waits for one to become routable)."""
    model = msg.get("model")
    adapters = known_adapters(everyone)
    adapter, explicit = requested_adapter(msg, everyone)
    if explicit and adapter not in adapters and all(adapters_of(b) is not None for b in everyone) and everyone:
        return "adapter_not_found", f"adapter {adapter!r} is not loaded on any backend"
    aliases = {alias_of(b) for b in everyone} - {None}
    if model is not None and aliases and model not in aliases and model not in adapters:
        return "model_not_found", (f"model {model!r} is not served by any backend "
                                   f"(served: {', '.join(sorted(aliases))})")
    return None
