"""What the disaggregation cost model (engine/balancer/pd_cost.py) predicts for a `bench serve disagg` run.

Its inputs are the `sim` backend's own latency model and transfer options
(with the run's `--backend-option`s over the sim's defaults) and the
scheduler's defaults the boards run with (chunk size, round robin weights),
so the prediction is of the modelled hardware, not of this machine: a loaded
machine adds host time per job the sim does not charge.
"""

from __future__ import annotations

import dataclasses
import inspect

from engine.balancer.pd_cost import Costs, Load, colocated, compare, disaggregated
from engine.core.scheduler_config import SchedulerConfig
from engine.flag_pairs import parse_pairs
from workers.backends.sim import SimBackend
from workers.backends.sim_latency import LatencyModel


def sim_costs(backend_options: list[str], max_inflight: int) -> Costs:
    """The costs of one `sim` chip started with `backend_options` (KEY=VALUE, as the daemon takes them)."""
    opts = parse_pairs(list(backend_options), "--backend-option")
    defaults = {k: p.default for k, p in inspect.signature(SimBackend.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    sim = {**defaults, **opts}
    lat = {f.name: sim[f.name] for f in dataclasses.fields(LatencyModel) if f.name in sim}
    lat["tp_degree"] = int(sim.get("tp_world", 1))
    scale = float(sim["time_scale"])
    s = SchedulerConfig()
    c = Costs.from_sim(LatencyModel(**lat), kv_block_bytes_model=int(sim["kv_block_bytes_model"]),
                       transfer_gbps=float(sim["transfer_gbps"]), transfer_base_ms=float(sim["transfer_base_ms"]),
                       block_size=int(sim["block_size"]), max_lanes=max(sim["profiles"]), inflight=max_inflight,
                       chunk_tokens=s.prefill_chunk_tokens, decode_weight=s.decode_weight,
                       prefill_weights=((s.short_prefill_max_tokens, s.short_prefill_weight),
                                        (s.medium_prefill_max_tokens, s.medium_prefill_weight),
                                        (None, s.long_prefill_weight)))
    if scale != 1.0:
        times = ("prefill_s_per_token", "decode_base_s", "decode_per_lane_s", "import_base_s", "import_s_per_block",
                 "host_s")
        c = dataclasses.replace(c, **{k: getattr(c, k) * scale for k in times})
    return c


def load_of(prompt_mean: float, output_mean: float, slo, rate: float = 1.0) -> Load:
    return Load(rate, max(1, round(prompt_mean)), max(1, round(output_mean)),
                None if slo.ttft_ms is None else slo.ttft_ms / 1000.0,
                None if slo.tpot_ms is None else slo.tpot_ms / 1000.0)


def predicted_goodput(costs: Costs, load: Load, side: str, rate: float) -> float:
    """The model's goodput (requests/s) of one side of the bench at `rate`."""
    if side == "disaggregated":
        return round(disaggregated(costs, load.at(rate), 1, 1).goodput, 3)
    return round(colocated(costs, load.at(rate), 2).goodput, 3)


def limit(costs: Costs, load: Load, measured_ratio: float | None, measured_break: float | None, target: float):
    """The measured goodput ratio at the co-located break point beside the model's bound there: every request
    offered at that rate meeting the SLO, over the model's co-located goodput (the model's own break point
    when the run had none)."""
    from tools.load.limits import Limit

    m = compare(costs, load)
    at = measured_break if measured_break is not None else m["break_rate"]
    inputs = {"model_break_rate": m["break_rate"], "capacity_co_located": m.get("capacity_co_located"),
              "capacity_split": m.get("capacity_split"), "capacity_ratio": m.get("capacity_ratio"),
              "min_split_prompt": m["min_split_prompt"], "min_winning_prompt": m.get("min_winning_prompt"),
              "prompt": load.prompt, "output": load.output, "inflight": costs.inflight}
    if at is None:
        return Limit("disaggregated / co-located goodput at the break point (cost model)", measured_ratio, None,
                     f">= {target}x", "the model has co-located TPOT P99 within the SLO up to its saturation: no "
                     f"break point; goodput capacity {m.get('capacity_ratio')}x", inputs=inputs)
    co = colocated(costs, load.at(at), 2)
    d = disaggregated(costs, load.at(at), 1, 1)
    bound = round(at / co.goodput, 3) if co.goodput > 0 else None
    inputs.update(rate=at, model_co_located_met=round(co.ttft_met * co.tpot_met, 4),
                  model_ratio=round(d.goodput / co.goodput, 3) if co.goodput > 0 else None)
    return Limit(f"disaggregated / co-located goodput at {at:g} req/s (cost model)", measured_ratio, bound,
                 f">= {target}x", f"every request meeting the SLO over the model's co-located share meeting it "
                 f"there ({inputs['model_co_located_met']})", inputs=inputs)
