"""The recording rules and alerts, as data: what each alert watches, how bad it is and what to do.

Every expression is written against the names a scrape stores (the
documented `npuserve:` names, the same in either exposition format) and
selects board series by `role="board"` (the label prometheus.yml gives
board targets). Recording rules are per board (`by (host, board)`) and named
`board:npuserve_<what>:<how>` after Prometheus's level:metric:operation
convention. Thresholds, the rate window and each alert's `for:` come from
`Params`, so `install-monitoring` flags can change them (the integration test
uses seconds; the defaults are for production).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from engine.daemon.observability.metrics import TTFT_BUCKETS
from tools.monitoring.durations import parse_seconds, render_seconds

B = 'role="board"'
BY = "host, board"
DOCS = "docs/troubleshooting.md"
# Multi-window burn rates (the SRE workbook's): a page when 2 % of a 30-day budget burns in an hour, a ticket
# when 5 % burns in six hours; each confirmed by a window a twelfth as long, so it resolves soon after.
FAST_BURN = (14.4, "1h", "5m")
SLOW_BURN = (6.0, "6h", "30m")
BURN_WINDOWS = ("5m", "30m", "1h", "6h")


@dataclass(frozen=True)
class Params:
    rate_window: str = "5m"
    kv_threshold: float = 0.9  # KV usage (0..1) that counts as full while requests wait
    queue_wait_slo_s: float = 10.0  # oldest admission wait
    ttft_slo_s: float = 2.5  # a TTFT bucket bound
    ttft_objective: float = 0.99  # share of requests whose TTFT is within the SLO
    error_ratio: float = 0.05
    preemptions_per_s: float = 1.0
    spec_acceptance_min: float = 0.3
    constraint_reject_ratio: float = 0.5
    for_overrides: dict = field(default_factory=dict)  # alert name -> `for:` duration

    def check(self) -> None:
        """Raises ValueError for a value the rules could not use."""
        parse_seconds(self.rate_window)
        if parse_seconds(self.rate_window) <= 0:
            raise ValueError("--rate-window must be longer than 0")
        if self.ttft_slo_s not in TTFT_BUCKETS:
            raise ValueError(f"--ttft-slo must be a bound of the TTFT histogram's buckets (seconds): "
                             f"{', '.join(floatToGoString(b) for b in TTFT_BUCKETS)}")
        for name, v in (("--kv-threshold", self.kv_threshold), ("--ttft-objective", self.ttft_objective),
                        ("--error-ratio", self.error_ratio), ("--spec-acceptance-min", self.spec_acceptance_min),
                        ("--constraint-reject-ratio", self.constraint_reject_ratio)):
            if not 0 < v < 1:
                raise ValueError(f"{name} must be between 0 and 1 (exclusive), got {v}")
        for name, v in (("--queue-wait-slo", self.queue_wait_slo_s), ("--preemptions-per-s", self.preemptions_per_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        names = {a.name for a in ALERTS}
        for name, dur in self.for_overrides.items():
            if name not in names:
                raise ValueError(f"--for {name}=...: no such alert (one of {', '.join(sorted(names))})")
            parse_seconds(dur)

    def for_(self, alert: "Alert") -> str:
        return render_seconds(parse_seconds(self.for_overrides.get(alert.name, alert.default_for)))

    @property
    def ttft_le(self) -> str:
        return floatToGoString(self.ttft_slo_s)  # the `le` label exactly as the exposition writes it


def recording_rules(p: Params) -> list[tuple[str, str]]:
    """(record, expr) in evaluation order."""
    w = p.rate_window

    def rate(metric: str, extra: str = "") -> str:
        return f"sum by ({BY}) (rate(npuserve:{metric}{{{B}{extra}}}[{w}]))"

    rules = [
        ("board:npuserve_generation_tokens:rate", rate("generation_tokens_total")),
        ("board:npuserve_prompt_tokens:rate", rate("prompt_tokens_total")),
        # success and failure summed as one selector: the failure counter has no series before the first failure
        ("board:npuserve_requests:rate", f"sum by ({BY}) (rate({{__name__=~\"npuserve:request_(success|failure)_total\","
                                         f"{B}}}[{w}]))"),
        ("board:npuserve_errors:rate", rate("request_failure_total")),
        ("board:npuserve_error_ratio:rate", "board:npuserve_errors:rate / board:npuserve_requests:rate"),
    ]
    for q in ("0.5", "0.9", "0.99"):
        pct = f"p{round(float(q) * 100)}"
        rules.append((f"board:npuserve_ttft_seconds:{pct}", f"histogram_quantile({q}, sum by ({BY}, le) "
                      f"(rate(npuserve:time_to_first_token_seconds_bucket{{{B}}}[{w}])))"))
        rules.append((f"board:npuserve_tpot_seconds:{pct}", f"histogram_quantile({q}, sum by ({BY}, le) "
                      f"(rate(npuserve:inter_token_latency_seconds_bucket{{{B}}}[{w}])))"))
    rules += [
        ("board:npuserve_requests_running:sum", f"sum by ({BY}) (npuserve:num_requests_running{{{B}}})"),
        ("board:npuserve_requests_waiting:sum", f"sum by ({BY}) (npuserve:num_requests_waiting{{{B}}})"),
        ("board:npuserve_admission_wait_seconds:max",
         f'max by ({BY}) (npuserve:queue_oldest_wait_seconds{{{B},queue="admission"}})'),
        ("board:npuserve_kv_usage:max", f"max by ({BY}) (npuserve:kv_cache_usage_perc{{{B}}})"),
        ("board:npuserve_chips_up:sum", f"sum by ({BY}) (npuserve:chip_up{{{B}}})"),
        ("board:npuserve_chip_busy:avg", f"avg by ({BY}) (npuserve:chip_busy_fraction{{{B}}})"),
        ("board:npuserve_accepting:min", f"min by ({BY}) (npuserve:accepting{{{B}}})"),
        ("board:npuserve_preemptions:rate", rate("num_preemptions_total")),
        ("board:npuserve_spec_acceptance:ratio",
         f"{rate('spec_decode_num_accepted_tokens_total')} / {rate('spec_decode_num_draft_tokens_total')}"),
        ("board:npuserve_constraint_reject:ratio",
         f"{rate('constraint_rejected_total')} / ({rate('constraint_compiles_total')} + "
         f"{rate('constraint_rejected_total')})"),
    ]
    for win in BURN_WINDOWS:  # the share of requests over the TTFT SLO, per window of the burn-rate alerts
        rules.append((f"board:npuserve_ttft_slo_misses:ratio_rate{win}",
                      f"1 - (sum by ({BY}) (rate(npuserve:time_to_first_token_seconds_bucket{{{B},"
                      f'le="{p.ttft_le}"}}[{win}])) / sum by ({BY}) '
                      f"(rate(npuserve:time_to_first_token_seconds_count{{{B}}}[{win}])))"))
    return rules


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str  # critical: page someone; warning: look today
    default_for: str
    meaning: str  # what happened (the `description` annotation, and the docs' list)
    action: str  # what to do (the `summary` annotation, and the docs' list)

    @property
    def anchor(self) -> str:
        return f"{DOCS}#{self.name.lower()}"

    def expr(self, p: Params) -> str:
        return _EXPRS[self.name](p)


def _burn(p: Params, factor: float, long: str, short: str) -> str:
    budget = factor * (1 - p.ttft_objective)
    return (f"board:npuserve_ttft_slo_misses:ratio_rate{long} > {budget:.6g} and "
            f"board:npuserve_ttft_slo_misses:ratio_rate{short} > {budget:.6g}")


def _chip_window(p: Params) -> str:
    """A restart stays visible for the `for:` plus the rate window, so one quick restart still fires."""
    alert = next(a for a in ALERTS if a.name == "NpuserveChipDown")
    return render_seconds(parse_seconds(p.for_(alert)) + parse_seconds(p.rate_window))


_EXPRS = {
    "NpuserveBoardDown": lambda p: f"up{{{B}}} == 0",
    "NpuserveChipDown": lambda p: (f"npuserve:chip_up{{{B}}} == 0 or "
                                   f"increase(npuserve:worker_restarts_total{{{B}}}[{_chip_window(p)}]) > 0"),
    "NpuserveNoChipUp": lambda p: ("board:npuserve_chips_up:sum == 0 and on (host, board) "
                                   "board:npuserve_requests_waiting:sum > 0"),
    "NpuserveKVCacheFull": lambda p: (f"board:npuserve_kv_usage:max > {p.kv_threshold:g} and on (host, board) "
                                      "board:npuserve_requests_waiting:sum > 0"),
    "NpuserveQueueWaitHigh": lambda p: f"board:npuserve_admission_wait_seconds:max > {p.queue_wait_slo_s:g}",
    "NpuserveTTFTBudgetBurnFast": lambda p: _burn(p, *FAST_BURN),
    "NpuserveTTFTBudgetBurnSlow": lambda p: _burn(p, *SLOW_BURN),
    "NpuserveErrorRatioHigh": lambda p: f"board:npuserve_error_ratio:rate > {p.error_ratio:g}",
    "NpuserveDrainStuck": lambda p: ("board:npuserve_accepting:min == 0 and on (host, board) "
                                     "(board:npuserve_requests_running:sum + board:npuserve_requests_waiting:sum)"
                                     " > 0"),
    "NpuservePreemptionStorm": lambda p: f"board:npuserve_preemptions:rate > {p.preemptions_per_s:g}",
    "NpuserveSpecAcceptanceCollapse": lambda p: f"board:npuserve_spec_acceptance:ratio < {p.spec_acceptance_min:g}",
    "NpuserveConstraintCompileFailures": lambda p: (f"board:npuserve_constraint_reject:ratio > "
                                                    f"{p.constraint_reject_ratio:g}"),
}

ALERTS = (
    Alert("NpuserveBoardDown", "critical", "1m",
          "Prometheus cannot scrape a board's /metrics: the daemon is down, hung (stopped, its loop wedged) or "
          "unreachable.",
          "Check the board's unit (systemctl status npuserve@N) and its health (npuserve health); restart it if "
          "it is hung."),
    Alert("NpuserveChipDown", "warning", "1m",
          "A chip's worker is out of service (chip_up 0) or was restarted (worker_restarts_total rose): a "
          "crash, a hang the supervisor killed, or a backend error.",
          "Read the board's chip_down log lines (reason, action=restart or out_of_service) and npuserve health; "
          "on an oversubscribed host raise recovery.heartbeat_timeout_ms, else replace the chip."),
    Alert("NpuserveNoChipUp", "critical", "1m",
          "No chip of the board is in service while requests wait: the board accepts work it cannot run.",
          "Drain the board at the balancer (npuserve admin drain --backend) and restart it; check the chips' "
          "reasons in npuserve health."),
    Alert("NpuserveKVCacheFull", "warning", "5m",
          "The board's KV cache is nearly full while requests wait for admission: the board is at capacity.",
          "Add boards or chips, lower max_tokens or admission.max_sequences, or turn on the host KV tier "
          "(kv.host_pool_mb)."),
    Alert("NpuserveQueueWaitHigh", "warning", "5m",
          "The oldest request waiting for admission has waited longer than the queue-wait SLO.",
          "Look at admission_blocked for why (kv, max_sequences, tenant_cap); add capacity or shed load "
          "(admission.max_queue_wait_ms)."),
    Alert("NpuserveTTFTBudgetBurnFast", "critical", "2m",
          "Time to first token misses its SLO fast enough to spend 2 % of a 30-day error budget in an hour "
          "(both the 1 h and the 5 min windows).",
          "Find the board's bottleneck now (queue wait, KV usage, chip busy fraction on the dashboard); add "
          "capacity or shed load."),
    Alert("NpuserveTTFTBudgetBurnSlow", "warning", "15m",
          "Time to first token misses its SLO fast enough to spend 5 % of a 30-day error budget in six hours.",
          "Plan capacity: compare the TTFT and queue panels with the traffic; tune admission or add boards."),
    Alert("NpuserveErrorRatioHigh", "warning", "5m",
          "A high share of the board's accepted requests end with an error event.",
          "Group npuserve:request_failure_total by reason on the dashboard; worker_died or job_timeout point at "
          "chips, deadline_exceeded at load."),
    Alert("NpuserveDrainStuck", "warning", "15m",
          "The board stopped accepting (a drain or shutdown) but requests are still in flight long after.",
          "Look for stuck streams (npuserve stats); finish the drain with a timeout (drain timeout_ms) or "
          "restart the board."),
    Alert("NpuservePreemptionStorm", "warning", "10m",
          "Sequences are preempted often: the KV pool keeps running dry and work is recomputed.",
          "Lower admission.max_sequences or max_tokens, or add KV (kv.num_blocks, the host tier)."),
    Alert("NpuserveSpecAcceptanceCollapse", "warning", "15m",
          "Speculative decoding accepts few of its draft tokens: it costs more than it saves.",
          "Check the draft model or n-gram settings against the traffic; turn speculation off for this "
          "workload."),
    Alert("NpuserveConstraintCompileFailures", "warning", "10m",
          "Most structured-output constraints fail to compile (400 invalid_constraint).",
          "Find the client sending the bad schema or grammar (the HTTP front's 400s); check that the grammar "
          "dialect is supported."),
)
assert {a.name for a in ALERTS} == set(_EXPRS)
