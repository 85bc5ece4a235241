"""What each wire op does once the frontend has decoded it.

Kept apart from the event loop so that the op table is readable on its own:
`generate` and `cancel` go to the scheduler core, `health`/`stats`/`models`
are answered by the views (engine/daemon/views.py), `drain`/`resume` toggle admission
(admin: only on ipc:// endpoints, whose socket file permissions are the
access control), and the model admin ops go to engine/daemon/models/admin_ops.py.
A generate is routed by its `model` (the board's default when absent) to
that alias's Ready generation and stays pinned to it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.actions import Action
from engine.core.requests import GenerateParams
from engine.core.retry_after import NOT_READY_RETRY_S, clamp_ms
from engine.daemon.constraint_cache import BOARD_CACHE, ConstraintRejected
from engine.daemon.text_io import TextRejected, prompt_of, split_stop
from engine.daemon.auth import refused_unless_admin, tenant_for, visible_stats
from engine.daemon.handoff.intake import take_handoff
from engine.daemon.handoff.shm import advertise, take_from_host_pool
from engine.daemon.log import log
from engine.daemon import lora_ops
from engine.daemon.models import admin_ops
from engine.core.model_table import RouteOutcome
from engine.core.penalty_spec import set_fields as penalty_fields, spec_of as penalties_of

if TYPE_CHECKING:
    from engine.daemon.frontend import Conn, Frontend
    from engine.daemon.generations import Generations
    from engine.daemon.models.generation import Generation
    from engine.daemon.views import Views

# Wire fields of `generate` that are scheduler parameters (model/stream are the shell's).
_PARAM_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
                 "ignore_eos", "deadline_ms", "tenant", "priority", "logprobs", "continuation", "speculative",
                 "top_logprobs", "prompt_logprobs")
NOT_IMPLEMENTED_OPS: frozenset[str] = frozenset()


def params_from(msg: dict, tokenizer=None) -> GenerateParams:
    """Scheduler parameters of a validated generate: a `text` prompt is tokenized, string stops split off.

    Raises TextRejected when the text cannot be tokenized for this model, or its `constraint` does not
    compile (`invalid_constraint`)."""
    fields = {k: msg[k] for k in _PARAM_FIELDS if k in msg}
    if fields.get("top_logprobs"):
        fields["logprobs"] = True  # alternatives come with the chosen token's logprob
    fields["prompt"] = prompt_of(msg, tokenizer)
    fields["stop"], fields["stop_strings"] = split_stop(msg.get("stop", []))
    c = msg.get("constraint")
    if c is not None:
        try:
            fields["constraint"] = BOARD_CACHE.get(c["kind"], c["body"])
        except ConstraintRejected as e:
            raise TextRejected("invalid_constraint", str(e)) from None
    fields["penalties"] = penalties_of(msg)
    return GenerateParams(**fields)


def logprob_refusal(params: GenerateParams, info, handoff: dict | None = None) -> tuple[str, str] | None:
    """(reason, message) of a 400 when the generation's backend cannot give the logprobs asked for."""
    extra = {} if info is None else info.extra
    if params.prompt_logprobs is not None and handoff is not None and not handoff.get("export"):
        return "prompt_logprobs_unsupported", ("prompt_logprobs: a decode leg's prompt was computed by the "
                                               "prefill board, which answers them")
    name = "this" if info is None else f"the {info.name}"
    if params.top_logprobs and extra.get("samples_on_device"):
        return "top_logprobs_unsupported", (f"top_logprobs: {name} backend samples on the device and returns no "
                                            "logits, so it has no alternatives to give")
    if params.prompt_logprobs is not None and not extra.get("prompt_logprobs"):
        return "prompt_logprobs_unsupported", (f"prompt_logprobs: {name} backend does not return the logits of "
                                               "prompt positions (echo with logprobs needs them)")
    return None


@dataclass(frozen=True)
class OpContext:
    """What the ops reach: the frontend, the generations, the views, and the loop's `apply` and admission."""

    frontend: "Frontend"
    gens: "Generations"
    views: "Views"
    apply: Callable[[list, "Generation", float], None]
    set_accepting: Callable[[bool], None]  # drain/resume (a SIGTERM drain cannot be resumed)
    transfers: Any = None  # engine.daemon.handoff.transfer.Transfers: KV pulls between boards, or None


def handle(o: OpContext, conn: "Conn", msg: dict, now: float) -> list[Action]:
    """Carry out one decoded request; returns the core actions it produced."""
    op = msg["op"]
    cid = msg["id"]
    fe, gens = o.frontend, o.gens
    if op == "generate":
        adapter = None
        if gens.lora.by_name or msg.get("adapter") is not None:
            try:
                adapter = lora_ops.pick_adapter(gens, {**msg, "tenant": tenant_for(conn, msg["tenant"])})
            except lora_ops.AdapterRejected as e:
                fe.error(conn, cid, e.code, e.reason, e.message)
                return []
            if adapter is not None:
                msg["model"] = adapter.base
        route = gens.models.route(msg.get("model"))
        if route.outcome is RouteOutcome.UNKNOWN:
            fe.error(conn, cid, 404, "model_not_found", route.message)
            return []
        if route.outcome is RouteOutcome.UNAVAILABLE:
            fe.error(conn, cid, 503, "model_unavailable", route.message, retryable=True,
                     retry_after_ms=clamp_ms(NOT_READY_RETRY_S))
            return []
        g = gens.generations[route.generation.id]
        msg["tenant"] = tenant_for(conn, msg["tenant"])
        try:
            params = params_from(msg, g.tokenizer)
        except TextRejected as e:
            fe.error(conn, cid, 400, e.reason, e.message)
            return []
        if params.constraint is not None and g.info is not None and g.info.extra.get("samples_on_device"):
            fe.error(conn, cid, 400, "constraint_unsupported", f"constraint: the {g.info.name} backend samples on "
                                                               "the device, so no token mask can apply")
            return []
        if params.penalties is not None and g.info is not None and g.info.extra.get("samples_on_device"):
            name = penalty_fields(msg)[0]
            fe.error(conn, cid, 400, f"{name}_unsupported", f"{name}: the {g.info.name} backend samples on the "
                                                           "device, so no penalty or bias can apply")
            return []
        refused = logprob_refusal(params, g.info, msg.get("handoff"))
        if refused is not None:
            fe.error(conn, cid, 400, *refused)
            return []
        if adapter is not None:
            lora_ops.apply_adapter(params, adapter)
        n = msg.get("n", 1)
        if n > 1 and "handoff" in msg:
            fe.error(conn, cid, 400, "conflicting_fields", "n, handoff: a prefill/decode leg has one choice")
            return []
        rids = [gens.next_request_id() for _ in range(n)]
        rid = rids[0]
        opened = fe.open(rid, conn, cid, bool(msg.get("stream", True)), params.logprobs,
                         text=g.tokenizer is not None, generation=g.id) if n == 1 else \
            fe.open_choices(rids, conn, cid, bool(msg.get("stream", True)), params.logprobs,
                            text=g.tokenizer is not None, generation=g.id)
        if not opened:
            fe.error(conn, cid, 400, "duplicate_id", f"request id {cid!r} is already in flight on this connection")
            return []
        if n > 1:  # the choices share the prompt's computation (engine/core/sched/choices.py)
            for r in rids:
                gens.admit(r, g)
            o.apply(g.scheduler.submit_choices(rids, params, now), g, now)
            return []
        if "handoff" in msg:
            tr = o.transfers
            if take_from_host_pool(g, msg["handoff"], params, None if tr is None else tr.client.ctx):
                pass  # one host: copied from the prefill board's host slot pool (engine/daemon/handoff/shm.py)
            elif tr is not None and tr.client.park(g, rid, msg["handoff"], params, now):
                return []  # submitted when the KV pull ends (engine/daemon/handoff/transfer.py)
            else:
                desc = take_handoff(g, gens.cfg, rid, msg["handoff"], params, now,
                                    {**({} if tr is None or tr.server is None else tr.server.descriptor_fields()),
                                     **advertise(g)})
                if desc is not None:
                    fe.set_handoff(rid, desc)
        gens.admit(rid, g)
        if adapter is not None:
            gens.lora.admit(rid, adapter)
        o.apply(g.scheduler.submit(rid, params, now), g, now)
        return []
    if op == "cancel":
        for rid in fe.lookup_all(conn, cid):  # every choice of a request with n > 1
            if o.transfers is not None:
                o.transfers.client.cancel(rid, now)  # a pull in progress ends; the request is submitted to be cancelled
            g = gens.generation_of(rid)
            if g is not None and g.scheduler is not None:
                o.apply(g.scheduler.cancel(rid, now), g, now)
        return []
    if op == "health":
        fe.reply(conn, cid, "health", o.views.health(now))
        return []
    if op == "stats":
        body = {**o.views.stats(now), "constraints": BOARD_CACHE.stats()}  # structured output: the board's compiles
        if gens.lora.by_name or gens.lora.loads:
            body["lora"] = gens.lora.stats()
        fe.reply(conn, cid, "stats", visible_stats(conn, jsonable(body)))
        return []
    if op == "models":  # open to every client, as before: a front or a balancer learns what is served
        fe.reply(conn, cid, "models", {"models": o.views.models_list() + gens.lora.entries()})
        return []
    if op in admin_ops.OPS:
        admin_ops.handle(gens, fe, conn, msg, now)
        return []
    if op in lora_ops.OPS:
        lora_ops.handle(gens, fe, conn, msg, now)
        return []
    if op in ("drain", "resume"):
        if refused_unless_admin(fe, conn, cid, op):
            return []
        if msg.get("backend") is not None:
            fe.error(conn, cid, 404, "backend_not_found", f"{op}: a board daemon has no backends; "
                                                          "send it without `backend`")
            return []
        o.set_accepting(op == "resume")
        if op == "drain":
            timeout_ms = msg.get("timeout_ms")
            gens.drain_board(now, gens.cfg.server.drain_timeout_s if timeout_ms is None else timeout_ms / 1000.0)
        fe.reply(conn, cid, op, {"accepting": gens.accepting})
        return []
    if op == "reenable_inflight":
        if refused_unless_admin(fe, conn, cid, op):
            return []
        done = {str(g.id): g.scheduler.reenable_inflight(msg.get("chip"))
                for g in gens.serving_generations() if g.scheduler is not None}
        log("inflight_reenabled", chip=msg.get("chip"), reenabled=done)
        fe.reply(conn, cid, op, {"reenabled": done})
        return []
    if op in NOT_IMPLEMENTED_OPS:
        fe.error(conn, cid, 501, "not_implemented", f"{op}: model management is not implemented by this daemon")
        return []
    fe.error(conn, cid, 400, "unknown_op", f"op {op!r} is not served here")
    return []


def jsonable(x: Any) -> Any:
    """Stats may hold enums, numpy scalars, tuples or non-finite floats: make them plain JSON."""
    if isinstance(x, dict):
        return {str(k.value if isinstance(k, enum.Enum) else k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in x]
    if isinstance(x, enum.Enum):
        return x.value if isinstance(x.value, (str, int)) else x.name
    if isinstance(x, bool) or x is None or isinstance(x, (str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item"):  # numpy scalar
        return jsonable(x.item())
    if hasattr(x, "tolist"):
        return jsonable(x.tolist())
    return str(x)
