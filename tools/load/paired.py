"""Sides of a comparison run in paired rounds: the one alternating loop, medians, ratios, targets, the report.

What every side-by-side benchmark of tools/bench shares. The machine is
noisy, so each round runs every side on the same requests back to back,
the order flips every round (`alternate`), and the verdict is on the medians
over rounds, with each round's own ratio beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from tools.load.report import publish, summarize, table
from tools.load.runner import Record
from tools.load.workload import Request

S, G, R, T = TypeVar("S"), TypeVar("G"), TypeVar("R"), TypeVar("T")
METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms")


@dataclass(frozen=True)
class Target:
    """A bound on a comparison, on the medians over rounds: `min`/`max`: subject / baseline >= / <= bound;
    `diff`: subject - baseline <= bound; `own_max`: each side's own value <= bound (no baseline needed)."""

    metric: str
    kind: str  # "min" | "max" | "diff" | "own_max"
    bound: float

    def __str__(self) -> str:
        if self.kind == "diff":
            return f"{self.metric} +{self.bound:g} at most"
        if self.kind == "own_max":
            return f"{self.metric} <= {self.bound:g}"
        return f"{'>=' if self.kind == 'min' else '<='} {self.bound:g}x"

    def met(self, value: float) -> bool:
        """`value` (the ratio, the difference for `diff`, the side's own for `own_max`) is on the right side."""
        return value >= self.bound if self.kind == "min" else value <= self.bound

    def margin(self, value: float) -> float:
        """How far on the right side of the bound (negative: missed by that much)."""
        return round(value - self.bound if self.kind == "min" else self.bound - value, 3)


def alternate(sides: Sequence[S], rounds: int, run: Callable[[S, int, G], R], *, groups: Sequence[G] = (None,),
              flip: Callable[[int, G], bool] = lambda rnd, group: rnd % 2 == 1) -> list[R]:
    """The one loop of every side-by-side comparison: each round, for each group (e.g. a concurrency), every
    side once, `run(side, round, group)`; the order reversed where `flip(round, group)` (every other round).

    Both sides of a round run back to back and the order flips, so a drift in the machine's load hits
    each side alike and a round's ratio is a paired measurement.
    """
    out = []
    for rnd in range(rounds):
        for group in groups:
            for side in (sides[::-1] if flip(rnd, group) else sides):
                out.append(run(side, rnd, group))
    return out


def per_round(make: Callable[[int], T]) -> Callable[[int], T]:
    """`make(round)`, made once per round however many sides ask (every side of a round gets the same)."""
    made: dict[int, T] = {}

    def get(rnd: int) -> T:
        if rnd not in made:
            made[rnd] = make(rnd)
        return made[rnd]
    return get


def run_rounds(routes: dict[str, Callable[[list[Request]], list[Record]]], make_requests: Callable[[int], list[Request]],
               rounds: int, extra: dict | None = None, on_row: Callable[[dict], None] | None = None,
               on_start: Callable[[str], None] | None = None) -> list[dict]:
    """Each round: the same requests (`make_requests(round)`) over every route, order flipped every round."""
    requests = per_round(make_requests)

    def run(label: str, rnd: int, _group) -> dict:
        reqs = requests(rnd)
        if on_start:
            on_start(f"round {rnd + 1}/{rounds}: {label}")
        row = {"label": label, "round": rnd + 1, **(extra or {}), **summarize(routes[label](reqs))}
        if on_row:
            on_row(row)
        return row

    return alternate(list(routes), rounds, run)


def medians(rows: list[dict], label: str, metrics: tuple[str, ...] = METRICS) -> dict[str, float | None]:
    """Per metric, the median over the rounds of `label`'s rows (None where no row has it)."""
    out = {}
    for m in metrics:
        vals = [r[m] for r in rows if r["label"] == label and r.get(m) is not None]
        out[m] = statistics.median(vals) if vals else None
    return out


def bound_within(per_round: list[float], bound: float) -> bool:
    """The bound lies between the lowest and highest of two or more paired rounds: the verdict on the median
    is then decided by the machine's drift, not by the two sides."""
    return len(per_round) > 1 and min(per_round) <= bound <= max(per_round)


def round_values(rows: list[dict], subject: str, baseline: str, metric: str, diff: bool) -> list[float]:
    """Each round's own subject/baseline ratio (or difference): both routes ran that round's requests back to
    back, so these are paired measurements, and their spread is what the machine's drift alone does."""
    by = {(r["label"], r["round"]): r.get(metric) for r in rows}
    out = []
    for rnd in sorted({r["round"] for r in rows}):
        s, b = by.get((subject, rnd)), by.get((baseline, rnd))
        if s is None or b is None or (not diff and not b):
            continue
        out.append(round(s - b if diff else s / b, 3))
    return out


def compare(rows: list[dict], subject: str, baseline: str, targets: list[Target], extra: dict | None = None,
            metrics: tuple[str, ...] = METRICS) -> list[dict]:
    """Per metric: subject / baseline on the medians (and the TTFT difference), with any target's verdict.

    A target row also carries the rounds' own values (`rounds`) and
    `within_spread`: the bound lies between the lowest and highest of them,
    so whether the median meets it is decided by noise, not by the routes.
    """
    s, b = medians(rows, subject, metrics), medians(rows, baseline, metrics)
    out = []
    for m in metrics:
        if s[m] is None or b[m] is None:
            continue
        row = {"subject": subject, "baseline": baseline, **(extra or {}), "metric": m, "subject_median": s[m],
               "baseline_median": b[m], "ratio": round(s[m] / b[m], 3) if b[m] else None,
               "difference": round(s[m] - b[m], 3)}
        for t in targets:
            if t.metric != m:
                continue
            if t.kind == "diff":
                value = row["difference"]
            elif row["ratio"] is None:
                continue
            else:
                value = row["ratio"]
            per_round = round_values(rows, subject, baseline, m, t.kind == "diff")
            out.append({**row, "target": str(t), "target_kind": t.kind, "bound": t.bound, "value": value,
                        "met": t.met(value), "margin": t.margin(value), "rounds": per_round,
                        "within_spread": bound_within(per_round, t.bound)})
            break
        else:
            out.append(row)
    return out


def format_comparison(comparison: list[dict]) -> str:
    lines = []
    for c in comparison:
        line = (f"  {c['metric']:<13} {c['subject']} {c['subject_median']:,.3f} vs {c['baseline']} "
                f"{c['baseline_median']:,.3f}: ratio {c['ratio'] if c['ratio'] is not None else '-'}, "
                f"difference {c['difference']:+,.3f}")
        if "target" in c:
            verdict = "met" if c["met"] else "MISSED"
            line += f"  [target {c['target']}: {verdict}, margin {c['margin']:+.3f}"
            if len(c["rounds"]) > 1:
                line += f"; rounds {min(c['rounds']):+,.3f} to {max(c['rounds']):+,.3f}" if c["target_kind"] == "diff" \
                    else f"; rounds {min(c['rounds']):.3f}-{max(c['rounds']):.3f}"
            if c["within_spread"]:
                line += ", the bound inside their spread"
            line += "]"
        lines.append(line)
    return "\n".join(lines)


def report(prog: str, title: str, rows: list[dict], comparison: list[dict], as_json: bool, summary: dict) -> int:
    """Print the runs and the comparison (a table, or JSON Lines: the rows, then one summary); the exit status."""
    met = [c["met"] for c in comparison if "met" in c]

    def text() -> str:
        lines = [title, table(rows), "(latencies in ms; subject against baseline on the medians over rounds below)"]
        for c in dict.fromkeys(x.get("concurrency") for x in comparison):
            lines += [f" concurrency {c}:", format_comparison([x for x in comparison if x.get("concurrency") == c])]
        return "\n".join(lines)

    json_lines = [*(("row", r) for r in rows),
                  ("summary", {**summary, "comparison": comparison, "targets_met": all(met) if met else None})]
    return publish(prog, as_json, json_lines, text, rows)
