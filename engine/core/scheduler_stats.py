"""The scheduler's stats view: the counts of the jobs it builds, and the snapshot an operator reads.

One home for what is counted per job and for the shape of the stats reply
(the daemon's `stats` op and its metrics read these keys). The view only
reads: the scheduler hands in its state explicitly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from operator import attrgetter

from engine.core.chip_state import ChipState
from engine.core.prefill_queues import PREFILL_CLASSES, WorkClass
from engine.core.request_record import RequestRecord

_ARRIVAL = attrgetter("arrival")
_READY_SINCE = attrgetter("ready_since")


class JobCounts:
    """Counters bumped once per job built, and the lanes per decode profile (compiled batch)."""

    def __init__(self, counters: Counter[str], profiles: Iterable[int]) -> None:
        self.counters = counters  # the scheduler's counters (one Counter: also rejections, faults...)
        # per decode profile: [jobs, active lanes]; slots - lanes is the lane waste
        self.decode_by_profile: dict[int, list[int]] = {b: [0, 0] for b in profiles}

    def decode_job(self, batch: int, lanes: int) -> None:
        c = self.counters
        c["decode_jobs"] += 1
        c["decode_lanes"] += lanes
        c["decode_lane_slots"] += batch
        by_profile = self.decode_by_profile[batch]
        by_profile[0] += 1
        by_profile[1] += lanes

    def prefill_job(self, tokens: int) -> None:
        self.counters["prefill_jobs"] += 1
        self.counters["prefill_tokens"] += tokens

    def mixed_job(self, decode_lanes: int, prompts: int, prompt_tokens: int) -> None:
        c = self.counters
        c["mixed_jobs"] += 1
        if decode_lanes:
            c["decode_lanes"] += decode_lanes
            c["decode_lane_slots"] += decode_lanes  # no padded lanes in a mixed job
        if prompts:
            c["prefill_jobs"] += 1
            c["prefill_lanes"] += prompts  # prompts per job = prefill_lanes / prefill_jobs
            c["prefill_tokens"] += prompt_tokens
            if decode_lanes:
                c["mixed_jobs_decode_and_prefill"] += 1

    def profile_stats(self) -> dict[int, dict[str, float | int | None]]:
        """Per decode profile: jobs, active lanes, lane slots, lane waste (inactive lanes) and fill ratio."""
        out: dict[int, dict[str, float | int | None]] = {}
        for batch, (jobs, lanes) in sorted(self.decode_by_profile.items()):
            slots = jobs * batch
            out[batch] = {"jobs": jobs, "lanes": lanes, "slots": slots, "lane_waste": slots - lanes,
                          "fill_ratio": lanes / slots if slots else None}
        return out


def queue_stats(now: float, requests: Mapping[int, RequestRecord], admission: list[int],
                chips: Iterable[ChipState]) -> dict[str, dict[str, dict[str, float]]]:
    """Depth and oldest wait (seconds) of every queue (npuserve:queue_depth, npuserve:queue_oldest_wait_seconds).

    "admission" is the board's waiting queue (`admission`: its request ids, waiting since
    arrival); per chip, "decode" and the prefill classes (waiting since the request
    became ready for its next job). O(queued requests): for periodic snapshots.
    """

    def entry(rids, since) -> dict[str, float]:
        oldest = min((since(requests[rid]) for rid in rids), default=None)
        return {"depth": len(rids), "oldest_wait_s": 0.0 if oldest is None else max(0.0, now - oldest)}

    out: dict[str, dict[str, dict[str, float]]] = {"board": {"admission": entry(admission, _ARRIVAL)}}
    for ch in chips:
        q = {WorkClass.DECODE.value: entry(list(ch.decode_ready), _READY_SINCE)}
        for c in PREFILL_CLASSES:
            q[c.value] = entry(list(ch.prefill.members(c)), _READY_SINCE)
        out[str(ch.chip)] = q
    return out


def chip_stats(ch: ChipState) -> dict:
    return {
        "in_service": ch.in_service, "inflight": len(ch.inflight), "queued_steps_inflight": ch.kv.queued_steps(),
        "bound": len(ch.bound),
        **({} if ch.governor is None else {"inflight_governor": ch.governor.stats()}),
        "jobs_submitted": ch.jobs_submitted, "faults": ch.faults, "kv": ch.kv.stats(),
        "wrr_picks": {c.value: n for c, n in ch.wrr.picks.items()},
    }


def scheduler_stats(*, accepting: bool, admission_blocked: str | None, profiles: tuple[int, ...], chunked: bool,
                    waiting_requests: int, waiting_prompt_tokens: int, active_sequences: int,
                    requests: Iterable[RequestRecord], chips: list[ChipState], jobs: JobCounts,
                    tenant_active: Mapping[str, int], tenant_service: Mapping[str, int],
                    generation_tokens: int, prompt_tokens: int, queue_waits: dict | None) -> dict:
    """Everything an operator may want, as plain data; `queue_waits` (queue_stats) when given."""
    counters = jobs.counters
    states: Counter[str] = Counter(r.state.value for r in requests)
    slots = counters["decode_lane_slots"]
    extra = {} if queue_waits is None else {"queue_waits": queue_waits}
    return {
        "accepting": accepting,
        "admission_blocked": admission_blocked,
        "profiles": list(profiles),
        "chunked_prefill": chunked,
        "waiting_requests": waiting_requests,
        "waiting_prompt_tokens": waiting_prompt_tokens,
        "active_sequences": active_sequences,
        "requests_by_state": dict(states),
        "queues": {str(ch.chip): {"decode": len(ch.decode_ready), **ch.prefill.depths()} for ch in chips},
        "chips": {str(ch.chip): chip_stats(ch) for ch in chips},
        "batch_fill_ratio": (counters["decode_lanes"] / slots) if slots else None,
        "tenant_active": {t: n for t, n in tenant_active.items() if n},
        "tenant_service_tokens": dict(tenant_service),
        "counters": dict(counters, generation_tokens=generation_tokens, prompt_tokens=prompt_tokens),
        "decode_profiles": jobs.profile_stats(),
        **extra,
    }
