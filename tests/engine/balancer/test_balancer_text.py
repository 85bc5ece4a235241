"""Text prompts through the balancer core (fake clock): routed by text chunks, migrated with their text,
text deltas passed through, the backend's prompt token count reported."""

from __future__ import annotations

import random

from engine.balancer.actions import EmitTokens, FinishRequest
from engine.balancer.backend_state import BackendSpec
from engine.balancer.core import BalancerCore, CoreConfig
from engine.balancer.routing import Policy, RoutingPolicy
from ipc.schema import validate_request

from test_balancer_core import A, B, C, beat, make, sends


def gen_text(text: str, **kw) -> dict:
    return validate_request({"v": 1, "op": "generate", "id": "x", "text": text, **kw})


def test_text_prompts_sharing_a_prefix_go_to_the_same_backend():
    cfg = CoreConfig(routing=RoutingPolicy(policy=Policy.PREFIX, block_size=4, decode_cost_tokens=1))
    core = BalancerCore(cfg, [BackendSpec(A), BackendSpec(B)], 0.0, random.Random(1))
    beat(core, 0.0)
    system = "You are a helpful assistant. Answer briefly and truthfully. " * 2  # 120 characters
    (first,) = sends(core.submit(1, gen_text(system + "What is 2+2?"), 0.1))
    (second,) = sends(core.submit(2, gen_text(system + "Name a colour."), 0.1))
    assert second.backend == first.backend
    (fresh,) = sends(core.submit(3, gen_text("Entirely different words here, long enough to fill chunks."), 0.1))
    assert fresh.backend != first.backend  # nothing cached there, and the first backend carries load
    assert first.msg["text"].startswith(system) and first.msg.get("prompt") is None


def test_text_stream_is_migrated_with_its_text_and_deltas_pass_through():
    core = make(names=(A, B, C))
    (s,) = sends(core.submit(1, gen_text("héllo", seed=3, max_tokens=5), 0.1))
    out = core.on_event(s.backend, {"v": 1, "ev": "tokens", "id": s.msg["id"], "tokens": [104, 195],
                                    "text": "h"}, 0.2)
    assert [(a.tokens, a.text) for a in out if isinstance(a, EmitTokens)] == [([104, 195], "h")]
    (m,) = sends(core.on_disconnect(s.backend, 0.3))
    assert m.msg["text"] == "héllo" and m.msg["continuation"] == [104, 195] and m.msg["seed"] == 3
    out = core.on_event(m.backend, {"v": 1, "ev": "tokens", "id": m.msg["id"], "tokens": [169], "text": "é"}, 0.4)
    out += core.on_event(m.backend, {"v": 1, "ev": "done", "id": m.msg["id"], "finish_reason": "length",
                                     "usage": {"prompt_tokens": 6, "completion_tokens": 1, "cached_tokens": 0},
                                     "timing": {"ttft_ms": 1.0, "tpot_ms": None, "e2e_ms": 1.0}}, 0.5)
    assert [a.text for a in out if isinstance(a, EmitTokens)] == ["é"]
    (fin,) = [a for a in out if isinstance(a, FinishRequest)]
    assert fin.usage["prompt_tokens"] == 6 and fin.usage["completion_tokens"] == 3
