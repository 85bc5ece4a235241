"""A figure beside the model of its limit: what bounds it, measured in the same run, and its target.

A benchmark's ratio alone does not say whether the work left is in the
scheduler or in the hardware: 0.90x llama.cpp with the chip busy 60 % of
the time leaves 1.5x on the table, with the chip busy all the time none
(the same work per token cannot go faster). Each model below turns what the
run measured into `bound`, the best the figure can be while that limit
holds; `report.publish(limits=...)` prints figure, bound and target side by
side (`--json`: kind `limit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limit:
    measure: str  # the figure's name, as the benchmark's row
    figure: float | None
    bound: float | None  # the best the figure can be under `limited_by` (None: not measured this run)
    target: str  # e.g. ">= 1.03x"
    limited_by: str  # what bounds it, in words
    higher_is_better: bool = True
    inputs: dict = field(default_factory=dict)  # the measurements the bound came from

    @property
    def of_bound(self) -> float | None:
        """How close the figure is to its bound: 1.0 at the limit, below it short of it."""
        if self.figure is None or self.bound is None or not self.figure or not self.bound:
            return None
        return round(self.figure / self.bound if self.higher_is_better else self.bound / self.figure, 3)

    def to_dict(self) -> dict:
        return {"measure": self.measure, "figure": self.figure, "bound": self.bound, "of_bound": self.of_bound,
                "target": self.target, "limited_by": self.limited_by,
                "better": "higher" if self.higher_is_better else "lower", "inputs": dict(self.inputs)}


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def busy(measure: str, ratio: float | None, chip_busy: float | None, target: str, **inputs) -> Limit:
    """Throughput against a peer: with the chip busy a fraction `chip_busy` of the run, the same work per
    token done back to back gives at most ratio / chip_busy (at busy 1.0 only less work per token helps)."""
    bound = ratio / chip_busy if ratio is not None and chip_busy else None
    return Limit(measure, _r(ratio), _r(bound), target, f"chip busy {_r(chip_busy)}: the same jobs with no idle time",
                 inputs={"chip_busy": chip_busy, **inputs})


def pingpong(measure: str, ratio: float | None, sync_busy: float | None, target: str, **inputs) -> Limit:
    """Two jobs in flight against one: they can only fill the time the chip idles with one in flight, so
    the speed-up is at most 1 / (one-in-flight busy fraction); at busy 1.0 a split only costs."""
    bound = 1.0 / sync_busy if sync_busy else None
    return Limit(measure, _r(ratio), _r(bound), target, f"one in flight keeps the chip busy {_r(sync_busy)}",
                 inputs={"sync_busy": sync_busy, **inputs})


def speculation(measure: str, ratio: float | None, tokens_per_step: float | None, cost_per_step: float | None,
                target: str, **inputs) -> Limit:
    """Speculative decoding: a verification step yields `tokens_per_step` tokens (per lane, against one for a
    plain step) at `cost_per_step` plain steps; the expected speed-up is their quotient."""
    bound = tokens_per_step / cost_per_step if tokens_per_step and cost_per_step else None
    return Limit(measure, _r(ratio), _r(bound), target,
                 f"{_r(tokens_per_step)} tokens per verification step at {_r(cost_per_step)} decode steps each",
                 inputs={"tokens_per_step": _r(tokens_per_step), "cost_per_step": _r(cost_per_step), **inputs})


def latency_floor(measure: str, ratio: float | None, floor_ratio: float | None, limited_by: str, target: str,
                  **inputs) -> Limit:
    """A latency ratio (lower is better) whose floor is another latency measured in the same run over the
    peer's: e.g. the TPOT P99 without the constraint, a plain decode step."""
    return Limit(measure, _r(ratio), _r(floor_ratio), target, limited_by, higher_is_better=False, inputs=inputs)


def offered(measure: str, ratio: float | None, rate: float | None, baseline_goodput: float | None, target: str,
            **inputs) -> Limit:
    """Goodput against a baseline at an arrival rate: at most every offered request meeting the SLO."""
    bound = rate / baseline_goodput if rate and baseline_goodput else None
    return Limit(measure, _r(ratio), _r(bound), target,
                 f"every request at {rate} req/s meeting the SLO (the baseline's goodput {baseline_goodput})",
                 inputs={"rate": rate, "baseline_goodput": baseline_goodput, **inputs})


def work_ratio(measure: str, ratio: float | None, ours: float | None, theirs: float | None, what: str, target: str,
               higher_is_better: bool = False, **inputs) -> Limit:
    """A latency or throughput ratio bounded by the ratio of the work each side did (prompt tokens
    computed, tokens per job): with equal speed per unit of work, the figure is that work ratio."""
    bound = ours / theirs if ours is not None and theirs else None
    return Limit(measure, _r(ratio), _r(bound), target, f"the work ratio: {what} {ours} vs {theirs}",
                 higher_is_better=higher_is_better, inputs={"ours": ours, "theirs": theirs, **inputs})


def own_best(measure: str, ratio: float | None, best: float | None, peer: float | None, what: str, target: str,
             **inputs) -> Limit:
    """Throughput against a peer, bounded by the subject's own best on easier work measured in the same run
    (e.g. its base-only tokens/s under a mix of adapters): the harder work adds cost, never speed."""
    bound = best / peer if best is not None and peer else None
    return Limit(measure, _r(ratio), _r(bound), target, f"{what}: {_r(best, 1)} vs the peer's {_r(peer, 1)}",
                 inputs={"best": _r(best, 1), "peer": _r(peer, 1), **inputs})


def unmodelled(measure: str, figure: float | None, target: str, why: str) -> Limit:
    return Limit(measure, _r(figure), None, target, why)
