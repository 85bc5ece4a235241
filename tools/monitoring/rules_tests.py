"""npuserve.rules.test.yml: `promtool test rules` cases, for every alert one where it fires and one where not.

The series are synthetic, in the shape a board exports them (labels of a
board target, the documented names). Times follow the rules' own windows and
`for:` durations, so the file stays true to whatever flags wrote the rules:
a firing case is evaluated after the condition has held for `for:`; a quiet
case is the same board with the one fact that makes the alert wrong removed.
"""

from __future__ import annotations

import math

import yaml

from tools.monitoring.alerts import ALERTS, FAST_BURN, SLOW_BURN, Alert, Params
from tools.monitoring.durations import parse_seconds, render_seconds
from tools.monitoring.rules_file import RULES_NAME, annotations

TARGET = {"job": "npuserve-board", "instance": "board0.example:9400", "role": "board", "host": "board0.example",
          "board": "0"}
BOARD = {"host": TARGET["host"], "board": TARGET["board"]}
MODEL = {"model_name": "m", "generation": "1"}


def _series(name: str, values: str, **labels: str) -> dict:
    lab = {**TARGET, **MODEL, **labels} if name != "up" else dict(TARGET)
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in lab.items()) + "}", "values": values}


class _Case:
    """One alert's timing: the sample step, when the condition starts and when it is judged."""

    def __init__(self, p: Params, alert: Alert, window_s: float) -> None:
        self.for_s = parse_seconds(p.for_(alert))
        self.step = float(max(1, min(60, math.floor(window_s / 4))))
        self.eval_s = self.step * math.ceil((self.for_s + 2 * window_s + 3 * self.step) / self.step)
        self.n = int(self.eval_s / self.step) + 5  # samples past the evaluation (a rate needs two)

    def flat(self, v: float) -> str:
        return f"{v:g}x{self.n}"

    def ramp(self, per_step: float) -> str:
        return f"0+{per_step:g}x{self.n}"

    def after_first(self, first: float, then: float) -> str:
        return f"{first:g} {then:g}x{self.n}"


def _cases(p: Params, a: Alert, c: _Case) -> tuple[list[dict], list[dict], list[dict]]:
    """(firing input, quiet input, the firing alerts' label sets without severity)."""
    s = _series
    chip0, chip1 = {"chip": "0"}, {"chip": "1"}
    name = a.name
    if name == "NpuserveBoardDown":
        return [s("up", c.after_first(1, 0))], [s("up", c.flat(1))], [TARGET]
    if name == "NpuserveChipDown":
        # chip 0 restarted once (quickly: chip_up never showed 0), chip 1's worker is out of service
        k = int((c.eval_s - c.for_s - c.step) / c.step)
        fire = [s("npuserve:chip_up", c.flat(1), **chip0),
                s("npuserve:worker_restarts_total", f"0x{k} 1x{c.n}", **chip0),
                s("npuserve:chip_up", c.after_first(1, 0), **chip1),
                s("npuserve:worker_restarts_total", c.flat(0), **chip1)]
        quiet = [s("npuserve:chip_up", c.flat(1), **chip0), s("npuserve:worker_restarts_total", c.flat(3), **chip0)]
        return fire, quiet, [{**TARGET, **MODEL, **chip0}, {**TARGET, **MODEL, **chip1}]
    if name == "NpuserveNoChipUp":
        base = [s("npuserve:chip_up", c.flat(0), **chip0)]
        return (base + [s("npuserve:num_requests_waiting", c.flat(3))],
                base + [s("npuserve:num_requests_waiting", c.flat(0))], [BOARD])
    if name == "NpuserveKVCacheFull":
        base = [s("npuserve:kv_cache_usage_perc", c.flat(1))]
        return (base + [s("npuserve:num_requests_waiting", c.flat(2))],
                base + [s("npuserve:num_requests_waiting", c.flat(0))], [BOARD])
    if name == "NpuserveQueueWaitHigh":
        high = c.flat(10 * p.queue_wait_slo_s)
        return ([s("npuserve:queue_oldest_wait_seconds", high, chip="board", queue="admission")],
                [s("npuserve:queue_oldest_wait_seconds", c.flat(0), chip="board", queue="admission"),
                 s("npuserve:queue_oldest_wait_seconds", high, chip="0", queue="decode")], [BOARD])
    if name in ("NpuserveTTFTBudgetBurnFast", "NpuserveTTFTBudgetBurnSlow"):
        bucket, count = "npuserve:time_to_first_token_seconds_bucket", "npuserve:time_to_first_token_seconds_count"
        le = {"le": p.ttft_le}
        return ([s(count, c.ramp(10)), s(bucket, c.flat(0), **le)],
                [s(count, c.ramp(10)), s(bucket, c.ramp(10), **le)], [BOARD])
    if name == "NpuserveErrorRatioHigh":
        ok, bad = "npuserve:request_success_total", "npuserve:request_failure_total"
        return ([s(ok, c.flat(0), finished_reason="length"), s(bad, c.ramp(10), reason="job_failed")],
                [s(ok, c.ramp(10), finished_reason="length"), s(bad, c.flat(0), reason="job_failed")], [BOARD])
    if name == "NpuserveDrainStuck":
        def board(running: float) -> list[dict]:
            return [s("npuserve:accepting", c.after_first(1, 0)), s("npuserve:num_requests_running", c.flat(running)),
                    s("npuserve:num_requests_waiting", c.flat(0))]
        return board(2), board(0), [BOARD]
    if name == "NpuservePreemptionStorm":
        per_step = math.ceil(10 * p.preemptions_per_s * c.step)
        return ([s("npuserve:num_preemptions_total", c.ramp(per_step))],
                [s("npuserve:num_preemptions_total", c.flat(0))], [BOARD])
    if name == "NpuserveSpecAcceptanceCollapse":
        drafts, acc = "npuserve:spec_decode_num_draft_tokens_total", "npuserve:spec_decode_num_accepted_tokens_total"
        return ([s(drafts, c.ramp(100)), s(acc, c.flat(0))], [s(drafts, c.ramp(100)), s(acc, c.ramp(100))], [BOARD])
    if name == "NpuserveConstraintCompileFailures":
        rej, comp = "npuserve:constraint_rejected_total", "npuserve:constraint_compiles_total"
        return ([s(rej, c.ramp(10)), s(comp, c.flat(0))], [s(rej, c.flat(0)), s(comp, c.ramp(10))], [BOARD])
    raise AssertionError(f"no unit test for {name}")


def _window_s(p: Params, a: Alert) -> float:
    if a.name == "NpuserveTTFTBudgetBurnFast":  # every request misses from the start: the short window decides
        return parse_seconds(FAST_BURN[2])
    if a.name == "NpuserveTTFTBudgetBurnSlow":
        return parse_seconds(SLOW_BURN[2])
    return parse_seconds(p.rate_window)


def render(p: Params, docs_url: str = "") -> str:
    tests = []
    steps = []
    for a in ALERTS:
        c = _Case(p, a, _window_s(p, a))
        steps.append(c.step)
        fire, quiet, firing = _cases(p, a, c)
        expected = [{"exp_labels": {**lab, "severity": a.severity}, "exp_annotations": annotations(a, docs_url)}
                    for lab in firing]
        at = render_seconds(c.eval_s)
        for series, exp in ((fire, expected), (quiet, [])):
            tests.append({"interval": render_seconds(c.step), "input_series": series,
                          "alert_rule_test": [{"eval_time": at, "alertname": a.name, "exp_alerts": exp}]})
    doc = {"rule_files": [RULES_NAME], "evaluation_interval": render_seconds(min(steps)), "tests": tests}
    head = ("# Written by `npuserve install-monitoring`: promtool test rules npuserve.rules.test.yml\n"
            "# For every alert, two cases in turn: the fault (it fires) and the same board without it (it does not).\n")
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)
