"""Scheduler configuration, and the adapter from the daemon's TOML config.

`scheduler_config_from` reads attributes duck-typed (getattr with defaults)
so that the core does not import `engine.config` and stays usable by the
simulator and tests with a plain `SchedulerConfig(...)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TenantPolicy:
    """Control-plane settings of one tenant (never taken from request fields)."""

    weight: float = 1.0
    max_active_sequences: int | None = None  # admitted, not yet terminal
    max_waiting_tokens: int | None = None  # prompt tokens waiting for admission

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError("tenant weight must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    # admission budget
    max_sequences: int = 256
    max_kv_tokens: int = 0  # KV tokens the admitted sequences may hold reserved, board-wide; 0 = the KV pool
    max_waiting_requests: int = 128
    max_waiting_prompt_tokens: int = 262_144
    default_deadline_s: float | None = 120.0
    # longest wait for admission (a burst beyond capacity gets 429 queue_wait_exceeded, not a late answer); 0 = off
    max_queue_wait_s: float = 0.0
    kv_watermark: float = 0.01  # fraction of a chip's blocks kept free at admission for decode growth
    # queues: weighted round robin of job opportunities
    decode_weight: int = 8
    short_prefill_weight: int = 4
    medium_prefill_weight: int = 2
    long_prefill_weight: int = 1
    short_prefill_max_tokens: int = 512
    medium_prefill_max_tokens: int = 4096
    decode_cost_weight: float = 1.0  # WFQ cost = prompt + decode_cost_weight * max_tokens
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    default_tenant: TenantPolicy = TenantPolicy()
    # One tenant's share of the lanes: of a decode batch's lanes, and of the admitted sequences
    # (max_sequences) while another tenant waits under its share -- then the over-share tenant's youngest
    # idle lane is preempted (recompute) to make room. Below 1 so that a tenant flooding
    # a full board cannot make another's request wait for one of its own to finish.
    max_tenant_lane_share: float = 0.5
    # batches
    profiles: tuple[int, ...] | None = None  # None: every profile the model declares
    profile_fill_ratio: float = 0.75  # B16 at >=12 ready, B8 at >=6, B4 at >=3 (engine.core.batch_profiles)
    batching_window_s: float = 0.0
    # mixed jobs: hold a job of prompts alone until arrivals pause this long (0 here, for the tests and the
    # simulator; the daemon's config default, batch.prefill_window_us, is 2 ms)
    prefill_window_s: float = 0.0
    chunked_prefill: bool = True  # effective only when the model declares it
    prefill_chunk_tokens: int = 512
    # Mixed batches (when the model declares them): each job carries the ready decode lanes and, beside
    # them, prompt chunks up to `mixed_token_budget` tokens in all (0: the backend's limit), as
    # llama.cpp's server and vLLM do; one pass over the weights serves both. The budget bounds the step
    # a prompt burst imposes on the running streams: 512, llama.cpp's physical batch (n_ubatch), so a
    # long prompt rides in ubatch-sized pieces with the decode lanes stepping between them instead of
    # the whole prompt (the backend's limit is max_seq) in one job that every stream waits for.
    mixed_batches: bool = True
    mixed_token_budget: int = 512
    # While decode lanes run on the chip, a mixed job computes at most this many prompt tokens (0: the
    # budget alone), so each step the streams wait for costs about a plain decode step plus this share;
    # a prompt longer than that goes in chunks of it, one per job, when the backend chunks prefills
    # (BatchPlanner.prompt_room). 256, half of llama.cpp's n_ubatch: on a CPU a job's prompt tokens
    # dominate its cost, so this halves the running streams' worst gap behind a long prompt, and the
    # prompt pays about one more plain decode step per extra job. A token count, not a measured cost,
    # so that what a job carries does not depend on timing.
    prompt_tokens_while_decoding: int = 256
    # While no stream on the chip is decoding (a burst of prompts on an idle chip), the budget bounds no
    # stream's step: a job takes up to `burst_token_budget` (at most the backend's limit; 0 or below
    # mixed_token_budget: off), so the burst's streams start together, in two jobs of llama.cpp's server's
    # n_batch (2048) for 32 x 128 tokens, instead of in 512-token stages whose first streams finish ten
    # steps before the last ones, in steps of fewer and fewer lanes. A stream is decoding from its second
    # token on, so a burst's first streams wait for at most one such job.
    burst_token_budget: int = 2048
    # speculative decoding (engine.core.spec): "off" | "ngram" by default for requests that do not say
    spec_method: str = "off"
    spec_max_draft_tokens: int = 4
    spec_max_batch_lanes: int = 4  # no drafts in a job of more decode lanes (compute-bound)
    spec_k_choice: str = "cost"  # "cost": k from the measured step cost and the lane's acceptance; "adaptive"
    # executor
    max_inflight: int = 1
    # Queue a decode lane's next step while its current one runs; off until measured faster.
    queue_next_step: bool = False
    # Multi-step decode: a decode job runs up to this many steps on the worker when the batch is
    # stable (no prompt waiting, no deadline within decode_steps_deadline_margin_s); 1 = off.
    decode_steps: int = 1
    decode_steps_deadline_margin_s: float = 1.0
    # Ping/pong's automatic downgrade to one job in flight (engine/core/inflight_governor.py): after this
    # many job timeouts (0 = never), or when TPOT P99 passes this ratio x the one-in-flight window's (0 = off).
    downgrade_timeouts: int = 2
    downgrade_tpot_p99_ratio: float = 0.0
    downgrade_window: int = 256
    # Ping/pong must pay: a chip measures its delivered tokens/s with max_inflight jobs and with one, in
    # turns of `pingpong_gain_window` tokens, and keeps ping/pong only at +`pingpong_min_gain` or more (0: off).
    pingpong_min_gain: float = 0.10
    pingpong_gain_window: int = 1024
    job_timeout_s: float = 30.0
    max_retries: int = 2  # requeues of a request whose job failed before any token was emitted
    # kv
    prefix_cache: bool = True
    # The simulator's baseline: admit a new batch only once the previous one
    # has completely finished (static batching).
    static_batching: bool = False

    def __post_init__(self) -> None:
        positive = ("max_sequences", "max_inflight", "prefill_chunk_tokens", "short_prefill_max_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_queue_wait_s < 0:
            raise ValueError("max_queue_wait_s must be >= 0 (0: off)")
        if self.max_kv_tokens < 0:
            raise ValueError("max_kv_tokens must be >= 0 (0: the KV pool)")
        if self.medium_prefill_max_tokens < self.short_prefill_max_tokens:
            raise ValueError("medium_prefill_max_tokens must be >= short_prefill_max_tokens")
        for name in ("decode_weight", "short_prefill_weight", "medium_prefill_weight", "long_prefill_weight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (a zero weight starves its queue)")
        if self.mixed_token_budget < 0:
            raise ValueError("mixed_token_budget must be >= 0 (0: the backend's limit)")
        if self.prompt_tokens_while_decoding < 0:
            raise ValueError("prompt_tokens_while_decoding must be >= 0 (0: no cap beyond the mixed budget)")
        if self.burst_token_budget < 0:
            raise ValueError("burst_token_budget must be >= 0 (0: off)")
        if self.batching_window_s < 0 or self.prefill_window_s < 0 or self.job_timeout_s <= 0:
            raise ValueError("batching_window_s and prefill_window_s must be >= 0 and job_timeout_s > 0")
        if not 0 < self.max_tenant_lane_share <= 1:
            raise ValueError("max_tenant_lane_share must be in (0, 1]")
        if self.spec_max_draft_tokens < 0 or self.spec_max_batch_lanes < 0:
            raise ValueError("spec_max_draft_tokens and spec_max_batch_lanes must be >= 0")
        if not 0 < self.profile_fill_ratio <= 1:
            raise ValueError("profile_fill_ratio must be in (0, 1]")

    def tenant(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, self.default_tenant)


def _get(section: Any, name: str, default: Any) -> Any:
    if section is None:
        return default
    if isinstance(section, Mapping):
        value = section.get(name, default)
    else:
        value = getattr(section, name, default)
    return default if value is None else value


def _tenant_from(obj: Any) -> TenantPolicy:
    if isinstance(obj, (int, float)):
        return TenantPolicy(weight=float(obj))
    cap_seq = _get(obj, "max_active_sequences", None)
    cap_tok = _get(obj, "max_waiting_tokens", None)
    return TenantPolicy(
        weight=float(_get(obj, "weight", 1.0)),
        max_active_sequences=int(cap_seq) if cap_seq else None,  # 0 = unlimited
        max_waiting_tokens=int(cap_tok) if cap_tok else None,
    )


def scheduler_config_from(cfg: Any) -> SchedulerConfig:
    """Build a SchedulerConfig from an `engine.config.Config` (sections admission, queues, batch, executor, kv)."""
    d = SchedulerConfig()
    adm = _get(cfg, "admission", None)
    q = _get(cfg, "queues", None)
    b = _get(cfg, "batch", None)
    ex = _get(cfg, "executor", None)
    kv = _get(cfg, "kv", None)
    sp = _get(cfg, "speculative", None)
    deadline_ms = _get(adm, "deadline_default_ms", None)
    tenants_raw = _get(q, "tenants", {}) or {}
    tenants = {str(name): _tenant_from(t) for name, t in dict(tenants_raw).items()}
    default_tenant = tenants.get("default", d.default_tenant)
    profiles = _get(b, "profiles", None)
    return SchedulerConfig(
        max_sequences=int(_get(adm, "max_sequences", d.max_sequences)),
        max_kv_tokens=int(_get(adm, "max_kv_tokens", d.max_kv_tokens)),
        max_waiting_requests=int(_get(adm, "max_waiting_requests", d.max_waiting_requests)),
        max_waiting_prompt_tokens=int(_get(adm, "max_waiting_prompt_tokens", d.max_waiting_prompt_tokens)),
        max_queue_wait_s=int(_get(adm, "max_queue_wait_ms", round(d.max_queue_wait_s * 1000))) / 1000.0,
        default_deadline_s=(d.default_deadline_s if deadline_ms is None
                            else (None if int(deadline_ms) <= 0 else int(deadline_ms) / 1000.0)),
        decode_weight=int(_get(q, "decode_weight", d.decode_weight)),
        short_prefill_weight=int(_get(q, "short_prefill_weight", d.short_prefill_weight)),
        medium_prefill_weight=int(_get(q, "medium_prefill_weight", d.medium_prefill_weight)),
        long_prefill_weight=int(_get(q, "long_prefill_weight", d.long_prefill_weight)),
        short_prefill_max_tokens=int(_get(q, "short_prefill_max_tokens", d.short_prefill_max_tokens)),
        medium_prefill_max_tokens=int(_get(q, "medium_prefill_max_tokens", d.medium_prefill_max_tokens)),
        decode_cost_weight=float(_get(q, "decode_cost_weight", d.decode_cost_weight)),
        tenants=tenants,
        default_tenant=default_tenant,
        profiles=tuple(int(p) for p in profiles) if profiles else None,  # [] = every declared profile
        batching_window_s=float(_get(b, "batching_window_us", d.batching_window_s * 1e6)) / 1e6,
        prefill_window_s=float(_get(b, "prefill_window_us", d.prefill_window_s * 1e6)) / 1e6,
        chunked_prefill=bool(_get(b, "chunked_prefill", d.chunked_prefill)),
        prefill_chunk_tokens=int(_get(b, "prefill_chunk_tokens", d.prefill_chunk_tokens)),
        mixed_batches=bool(_get(b, "mixed_batches", d.mixed_batches)),
        mixed_token_budget=int(_get(b, "mixed_token_budget", d.mixed_token_budget)),
        prompt_tokens_while_decoding=int(_get(b, "prompt_tokens_while_decoding", d.prompt_tokens_while_decoding)),
        burst_token_budget=int(_get(b, "burst_token_budget", d.burst_token_budget)),
        spec_method=str(_get(sp, "method", d.spec_method)),
        spec_max_draft_tokens=int(_get(sp, "max_draft_tokens", d.spec_max_draft_tokens)),
        spec_k_choice=str(_get(sp, "k_choice", d.spec_k_choice)),
        spec_max_batch_lanes=int(_get(sp, "max_batch_lanes", d.spec_max_batch_lanes)),
        max_tenant_lane_share=float(_get(q, "max_tenant_lane_share", d.max_tenant_lane_share)),
        max_inflight=int(_get(ex, "max_inflight", d.max_inflight)),
        queue_next_step=bool(_get(ex, "queue_next_step", d.queue_next_step)),
        decode_steps=int(_get(ex, "decode_steps", d.decode_steps)),
        downgrade_timeouts=int(_get(ex, "downgrade_timeouts", d.downgrade_timeouts)),
        downgrade_tpot_p99_ratio=float(_get(ex, "downgrade_tpot_p99_ratio", d.downgrade_tpot_p99_ratio)),
        pingpong_min_gain=float(_get(ex, "pingpong_min_gain", d.pingpong_min_gain)),
        job_timeout_s=float(_get(ex, "job_timeout_ms", d.job_timeout_s * 1000)) / 1000.0,
        prefix_cache=bool(_get(kv, "prefix_cache", d.prefix_cache)),
        static_batching=bool(_get(b, "static_batching", d.static_batching)),
    )
