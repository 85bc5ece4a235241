"""The balancer core routes a request that names a LoRA adapter only to backends whose heartbeats report it
(fake clock, no processes)."""

from __future__ import annotations

from engine.balancer.actions import FailRequest, SendUpstream
from test_balancer_core import A, B, C, gen, health_body, make, sends


def beat_with(core, now, adapters: dict) -> None:
    """One tick; each backend answers its heartbeat with `adapters[backend]` (absent key: none reported)."""
    for a in core.tick(now):
        if isinstance(a, SendUpstream) and a.msg["op"] == "health":
            body = health_body()
            if adapters.get(a.backend) is not None:
                body["adapters"] = adapters[a.backend]
            core.on_event(a.backend, {"v": 1, "ev": "health", "id": a.msg["id"], **body}, now)


_rids = iter(range(100, 10_000))


def _routed(core, msgs) -> list[str]:
    out = []
    for m in msgs:
        (s,) = sends(core.submit(next(_rids), m, 1.0))
        out.append(s.backend)
        assert {k: v for k, v in s.msg.items() if k in ("model", "adapter")} == \
               {k: v for k, v in m.items() if k in ("model", "adapter")}  # sent on as named
    return out


def test_adapter_requests_go_only_to_the_backends_that_report_the_adapter():
    core = make(names=(A, B, C))
    beat_with(core, 1.0, {A: {"sql": "tiny"}, B: {}, C: {"sql": "tiny", "chat": "tiny"}})
    assert set(_routed(core, [gen(model="sql") for _ in range(6)])) == {A, C}
    assert set(_routed(core, [gen(adapter="sql", model="tiny") for _ in range(6)])) == {A, C}
    assert _routed(core, [gen(adapter="chat") for _ in range(3)]) == [C] * 3
    assert set(_routed(core, [gen(model="tiny") for _ in range(6)])) == {A, B, C}  # the base: anywhere
    assert core.health(1.0)["adapters"] == {"sql": "tiny", "chat": "tiny"}


def test_an_adapter_no_backend_reports_is_404_adapter_not_found_and_an_unknown_model_404_model_not_found():
    core = make()
    beat_with(core, 1.0, {A: {"sql": "tiny"}, B: {}})
    (f,) = [a for a in core.submit(1, gen(adapter="nope"), 1.0) if isinstance(a, FailRequest)]
    assert (f.code, f.reason) == (404, "adapter_not_found")
    (f,) = [a for a in core.submit(2, gen(model="nope"), 1.0) if isinstance(a, FailRequest)]
    assert (f.code, f.reason) == (404, "model_not_found")


def test_backends_that_report_no_adapters_still_take_an_explicit_adapter_when_none_is_known_to_hold_it():
    core = make()
    beat_with(core, 1.0, {})  # boards of a version that does not report adapters
    assert set(_routed(core, [gen(adapter="sql") for _ in range(4)])) == {A, B}
    (f,) = [a for a in core.submit(9, gen(model="sql"), 1.0) if isinstance(a, FailRequest)]
    assert (f.code, f.reason) == (404, "model_not_found")  # `model` names an alias there, as before
