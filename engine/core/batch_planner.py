"""Batch planning: which decode lanes and prompt chunks go in a chip's next job.

The decisions of job building, kept apart from their effects so that each
rule has one home and can be read (and changed) without the bookkeeping
around it: the decode profile for a ready count, the tenant lane share, a
prefill chunk's end, the mixed-job token budget and the prompt chunks that
fill it, and the batching / prefill windows. Sans-I/O and holding no
scheduler state: the scheduler grows KV for the lanes chosen (preempting when
the pool is dry), moves the requests and submits the job. Built from the
config, and built again when a reload changes it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from operator import attrgetter

from engine.core.batch_profiles import lanes_for
from engine.core.capped_prompts import PromptChunk, take_capped
from engine.core.logprob_asks import whole_prompt
from engine.core.prefill_queues import PrefillQueues, SmoothWeightedRoundRobin
from engine.core.request_record import RequestRecord
from engine.core.scheduler_config import SchedulerConfig

PREFILL_WINDOW_CAP = 8  # a held job of prompts leaves at most this many prefill windows after its oldest prompt
_DECODE_KEY = attrgetter("decode_key")


def hold_until(fire_at: float, window: float, held: list[RequestRecord], now: float) -> float | None:
    """None (fire now) from `fire_at` on, or sooner when holding longer would come within `window` of
    the earliest deadline of `held`; else the time to look again."""
    known = [r.deadline for r in held if r.deadline is not None]
    if known:
        fire_at = min(fire_at, min(known) - window)  # holding may never eat into the earliest deadline
    return None if now >= fire_at else fire_at


class BatchPlanner:
    def __init__(self, config: SchedulerConfig, profiles: tuple[int, ...], chunked: bool,
                 mixed_batch_tokens: int) -> None:
        self.profiles = profiles
        self.top = top = max(profiles)
        # Per decode job: the profile for n ready sequences, and the smallest profile holding n lanes,
        # for n = 0..max profile (more ready than that picks the largest). Tables, not a search per job.
        self._profile_for_ready = [lanes_for(n, profiles, config.profile_fill_ratio)[0] for n in range(top + 1)]
        self._profile_fitting = [min(b for b in profiles if b >= n) for n in range(top + 1)]
        self.chunked = chunked
        self.chunk = config.prefill_chunk_tokens
        self.lane_share = config.max_tenant_lane_share
        self.batching_window = config.batching_window_s
        self.prefill_window = config.prefill_window_s
        self.mixed_limit = mixed_batch_tokens
        # Tokens per mixed job; 0 when jobs are not mixed (the model does not declare it, or it is off).
        if not (config.mixed_batches and mixed_batch_tokens > 0):
            self.mixed_budget = 0
        else:
            budget = config.mixed_token_budget
            self.mixed_budget = mixed_batch_tokens if budget <= 0 else min(budget, mixed_batch_tokens)
        # Prompt tokens a mixed job takes while decode lanes run; 0: no cap. Only when prompts are chunked:
        # an unchunked prompt above it could never go (a backend that cannot chunk keeps the budget alone).
        cap = config.prompt_tokens_while_decoding
        self.prompt_cap = cap if (cap > 0 and chunked and self.mixed_budget) else 0
        # Tokens per mixed job while no stream on the chip is decoding (`job_budget`); == mixed_budget: off.
        self.burst_budget = max(self.mixed_budget, min(config.burst_token_budget, mixed_batch_tokens)) \
            if self.mixed_budget else 0

    # ------------------------------------------------------------ decode lanes
    def decode_candidates(self, ready: Collection[int], requests: Mapping[int, RequestRecord]) -> list[RequestRecord]:
        """Ready sequences by earliest deadline, then round robin: the lane whose last step is oldest first.

        The turn in `RequestRecord.decode_key` is drawn at admission (so
        newcomers queue in the fair queue's order; a requeued lane keeps its
        own) and again, in lane order, each time the lane gets a step. A lane
        passed over thus goes ahead of every lane served since: with n
        candidates for b lanes none waits more than about n / b jobs. A fixed
        order (deadline, fair-queue tag) would starve the lanes at its end
        whenever more are ready than the job takes -- 9 for a B8, 20 for a
        B16, or lanes followed step after step (executor.queue_next_step)
        ahead of a ready one -- until the lanes ahead finish. Lanes that all
        fit keep their order job after job (a followed batch stays as it is).
        Deadlines go first, so that a lane's turn never comes after its
        deadline for want of a place: a lane without one waits while lanes
        with deadlines fill the job; the tenant lane share applies on top
        (`pick_lanes`).
        """
        cands = [requests[rid] for rid in ready]
        cands.sort(key=_DECODE_KEY)
        return cands

    def decode_profile(self, ready: int) -> int:
        """The compiled batch a decode job aims for with `ready` candidates (== lanes_for(ready, ...)[0])."""
        table = self._profile_for_ready
        return table[min(ready, len(table) - 1)]

    def fitting_profile(self, lanes: int) -> int:
        """The smallest profile holding `lanes` lanes (the lanes that got KV room may be fewer than picked)."""
        return self._profile_fitting[lanes]

    def pick_lanes(self, cands: list[RequestRecord], batch: int) -> list[RequestRecord]:
        """Take `batch` candidates in order, capping each tenant's share unless nobody else is ready."""
        share = self.lane_share
        if share >= 1.0:
            return cands[:batch]
        if len({r.params.tenant for r in cands}) <= 1:
            return cands[:batch]  # one tenant: the cap, then the skipped ones in order, is exactly this
        cap = max(1, math.floor(share * batch))
        chosen: list[RequestRecord] = []
        skipped: list[RequestRecord] = []
        per_tenant: Counter[str] = Counter()
        for r in cands:
            if len(chosen) == batch:
                break
            t = r.params.tenant
            if per_tenant[t] < cap:
                per_tenant[t] += 1
                chosen.append(r)
            else:
                skipped.append(r)
        for r in skipped:
            if len(chosen) == batch:
                break
            chosen.append(r)
        return chosen

    # ------------------------------------------------------------ prompt chunks
    def prefill_end(self, start: int, target: int) -> int:
        """End of a prefill job's chunk from `start` towards `target` (the whole rest unless chunked)."""
        return min(target, start + self.chunk) if self.chunked else target

    def job_budget(self, lanes: Iterable[Collection[int]], requests: Mapping[int, RequestRecord]) -> int:
        """The token budget of a mixed job on a chip whose decode lanes (ready, or in its jobs in flight) are
        `lanes`: `mixed_budget` while one of them is a stream decoding (it bounds that stream's step), else
        `burst_budget`. A stream decodes from its second token on: the lanes a burst's first job prefilled
        wait for one more job of the burst, as the first slots of llama.cpp's server wait for its second
        n_batch, and then every stream of the burst steps together."""
        if self.burst_budget <= self.mixed_budget:
            return self.mixed_budget
        for rids in lanes:
            for rid in rids:
                r = requests.get(rid)
                if r is not None and r.generated > 1:
                    return self.mixed_budget
        return self.burst_budget

    def mixed_decode_lanes(self, cands: list[RequestRecord], budget: int, prompts_waiting: bool
                           ) -> list[RequestRecord]:
        """The decode lanes a mixed job offers a place: waiting prompts always get half the job."""
        room = max(1, budget // 2) if prompts_waiting else budget
        return self.pick_lanes(cands, min(len(cands), self.top, room))

    def prompt_room(self, left: int, decoding: bool) -> int:
        """The prompt tokens a mixed job may take of the `left` its decode lanes leave of the budget: while
        decode lanes run on the chip (`decoding`: in this job or in one in flight), at most
        `prompt_tokens_while_decoding`, so every step the running streams wait for costs about a plain
        decode step plus that share, however long the prompts arriving."""
        cap = self.prompt_cap
        return min(left, cap) if cap and decoding else left

    def burst_chunk_room(self, bursting: bool) -> int | None:
        """The tokens a burst's job gives prompt chunks (the cap while decoding); None: not a burst, or no cap.
        The burst budget is for whole prompts sharing a pass over the weights; a long prompt's chunks in it
        would hold back every stream's first token."""
        return self.prompt_cap if bursting and self.prompt_cap else None

    def capped(self, left: int, decoding: bool) -> bool:
        """The cap binds: decode lanes run and it is below the `left` the decode lanes leave of the budget."""
        return bool(self.prompt_cap) and decoding and self.prompt_cap < left

    def take_prompts(self, queues: PrefillQueues, wrr: SmoothWeightedRoundRobin,
                     requests: Mapping[int, RequestRecord], left: int, capped: bool = False,
                     chunk_room: int | None = None, lanes_wait: bool = False) -> tuple[list[PromptChunk], int]:
        """Prompt chunks for a mixed job with `left` tokens of budget (`prompt_room`); returns them and the
        budget left (negative: an unchunked prompt beyond it, see `trim_decode`).

        When the prompt cap binds (`capped`), the running streams' next
        prompts go first and a prompt above the cap keeps half of it:
        `capped_prompts.take_capped`; the same with chunks held to
        `chunk_room` tokens in all once streams wait for the job (a burst's
        job; `lanes_wait`: it carries decode lanes). Otherwise:

        Prompts are taken by the prefill classes' weighted round robin and
        popped from the chip's queues (the round robin's turn is part of the
        choice). A prompt longer than the chunk size is chunked to fit the
        budget left when chunked prefill is on (its next chunk goes first next
        time); a shorter one (or any, unchunked) that does not fit waits for
        the next job rather than leave a tail of a few tokens for a job of its
        own (it always fits an empty one: the backend's limit is at least
        max_seq).
        """
        chunk = self.chunk
        if capped or chunk_room is not None:
            return take_capped(queues, wrr, requests, left, self.top, chunk, chunk_room, lanes_wait)
        prompts: list[PromptChunk] = []
        while len(prompts) < self.top:
            classes = queues.nonempty()
            if not classes:
                break
            cls = wrr.pick(classes)
            assert cls is not None
            r = requests[queues.members(cls)[0]]
            start = r.committed
            need = r.prefill_target - start
            chunked = self.chunked and not whole_prompt(r)
            if need <= left:
                take = min(need, chunk) if chunked else need
            elif prompts and (not chunked or need <= chunk):
                break  # first in the next job: a short prompt is not split to fill a remainder
            elif chunked:
                if left <= 0:
                    break
                take = min(left, chunk)
            else:
                take = need  # unchunked and first in the job: whole (the decode lanes make room, trim_decode)
            queues.pop(cls)
            prompts.append((r, start, start + take))
            left -= take
        return prompts, left

    def trim_decode(self, decode: list[RequestRecord], prompt_tokens: int, left: int) -> list[RequestRecord]:
        """An unchunked prompt beyond the budget (left < 0): keep the job within the backend's limit by
        dropping decode lanes from the end (they stay ready for the next job)."""
        if left < 0:
            over = len(decode) + prompt_tokens - self.mixed_limit
            if over > 0:
                return decode[:max(0, len(decode) - over)]
        return decode

    # ------------------------------------------------------------------ windows
    def decode_hold(self, ready: Collection[int], requests: Mapping[int, RequestRecord], now: float
                    ) -> float | None:
        """The batching window: hold an unfilled batch briefly, never past the window nor near a deadline.
        None: the decode job may go now; else when to look again."""
        window = self.batching_window
        if window <= 0 or len(ready) >= self.top:
            return None
        held = [requests[rid] for rid in ready]
        return hold_until(min(r.ready_since for r in held) + window, window, held, now)

    def prompts_hold(self, queues: PrefillQueues, requests: Mapping[int, RequestRecord], budget: int, now: float
                     ) -> float | None:
        """The prefill window (mixed jobs): hold a job of prompts alone until the arrivals pause for the
        window, so that a burst shares one job instead of its first prompt running alone while the rest
        wait out that whole job; not once the waiting prompts fill a job, nor past PREFILL_WINDOW_CAP
        windows after the oldest arrived (a steady stream of arrivals never pauses).
        None: the job may go now; else when to look again."""
        window = self.prefill_window
        if window <= 0 or len(queues) >= self.top:
            return None
        waiting = [requests[rid] for rid in queues.ids()]
        if sum(r.prefill_target - r.committed for r in waiting) >= budget:
            return None
        since = [r.ready_since for r in waiting]
        return hold_until(min(max(since) + window, min(since) + PREFILL_WINDOW_CAP * window), window, waiting, now)
