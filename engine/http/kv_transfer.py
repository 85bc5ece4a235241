"""vLLM's prefill/decode contract (`kv_transfer_params`) on an npuserve front, pure: no I/O.

`vllm-router --vllm-pd-disaggregation --prefill URL --decode URL` (0.1.17) sends each request twice,
with one `x-request-id` (`___prefill_addr_H:P___decode_addr_H:P_<uuid>`) on both (docs/disaggregation.md):

1. to a prefill worker, non-streamed, with `max_tokens: 1`, `min_tokens: 1` and
   `kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`;
   it waits for the answer and takes the `kv_transfer_params` of the response body;
2. to a decode worker, the client's original body (its `max_tokens`, its `stream`) plus those
   `kv_transfer_params`; that answer is the client's. The prefill answer's text is dropped.

So a prefill leg maps to the wire's `handoff: {"export": true}` and its response carries vLLM's fields
(`do_remote_prefill: true`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`, ...) plus
our descriptor under `npuserve_handoff`; a decode leg's `kv_transfer_params` map back to a `handoff`
descriptor. The decode board samples the first token itself (the router does not send it), which
seeded sampling keyed by (seed, position) makes the same token as the prefill board's.
"""

from __future__ import annotations

from typing import Any

from engine.http.openai_error import bad
from ipc.schema import Z85_KEY_RE

FIELD = "kv_transfer_params"
OURS = "npuserve_handoff"
MAX_NAME = 128  # the wire's hand-off board/request names (ipc.schema MAX_ID_CHARS)


def is_prefill_leg(body: dict) -> bool:
    p = body.get(FIELD)
    return isinstance(p, dict) and p.get("do_remote_decode") is True


def handoff_of(v: Any) -> dict | None:
    """The wire `handoff` a body's `kv_transfer_params` asks for (None: not a hand-off leg)."""
    if v is None:
        return None
    if type(v) is not dict:
        raise bad(FIELD, "must be an object", "invalid_type")
    if v.get("do_remote_decode") is True:
        return {"export": True}
    if v.get("do_remote_prefill") is not True:
        return None
    ours = v.get(OURS)
    if isinstance(ours, dict) and isinstance(ours.get("board"), str) and isinstance(ours.get("request"), str):
        return _sane(ours)
    board = v.get("remote_engine_id") or (f"{v.get('remote_host')}:{v.get('remote_port')}"
                                          if v.get("remote_host") else "remote")
    request = v.get("remote_request_id") or "remote"
    return {"board": str(board)[:MAX_NAME], "request": str(request)[:MAX_NAME], "prompt_len": 0, "blocks": []}


def response_params(done: dict, wire_id: str, engine_id: str) -> dict:
    """The prefill leg's answer: what the router hands the decode worker (vLLM's NIXL-shaped fields)."""
    prompt_len = int((done.get("usage") or {}).get("prompt_tokens") or 0)
    desc = done.get("handoff") if isinstance(done.get("handoff"), dict) else {
        "board": engine_id[:MAX_NAME], "request": wire_id[:MAX_NAME], "prompt_len": prompt_len, "blocks": []}
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": desc["board"],
            "remote_request_id": desc["request"], "remote_block_ids": list(desc.get("blocks", [])),
            "remote_host": None, "remote_port": None, "tp_size": 1, OURS: desc}


def _sane(d: dict) -> dict:
    """Our descriptor as it came back through a router: anything the wire schema would refuse is dropped
    (a malformed hand-off is a recompute, not a failed request)."""
    out: dict[str, Any] = {"board": d["board"][:MAX_NAME] or "remote", "request": d["request"][:MAX_NAME] or "remote"}
    n = d.get("prompt_len")
    out["prompt_len"] = n if type(n) is int and 0 <= n < 1 << 20 else 0
    blocks = d.get("blocks")
    out["blocks"] = blocks if type(blocks) is list and len(blocks) <= 1 << 16 and all(
        type(b) is int and 0 <= b < 1 << 31 for b in blocks) else []
    layout = d.get("layout")
    if type(layout) is dict and len(layout) <= 16 and all(
            type(k) is str and len(k) <= 64 and type(x) in (int, str) and len(str(x)) <= 256
            for k, x in layout.items()):
        out["layout"] = layout
    ep = d.get("endpoint")  # the exporter's KV transfer endpoint (engine/daemon/handoff/transfer.py)
    if type(ep) is str and ep.startswith(("tcp://", "ipc://")) and len(ep) <= 256:
        out["endpoint"] = ep
    key = d.get("curve_key")
    if type(key) is str and Z85_KEY_RE.match(key):
        out["curve_key"] = key
    hp = d.get("host_pool")  # the exporter's host KV slot pool (engine/daemon/handoff/shm.py)
    if type(hp) is dict and sorted(hp) == ["host", "layout", "name", "slot_bytes", "slots"] and all(
            type(hp[k]) is str and 0 < len(hp[k]) <= 255 for k in ("host", "layout", "name")) and all(
            type(hp[k]) is int and 0 < hp[k] < 1 << 40 for k in ("slots", "slot_bytes")):
        out["host_pool"] = hp
    t = d.get("first_token")
    if type(t) is int and 0 <= t < 1 << 31:
        out["first_token"] = t
    return out
