"""One job on the backend: the worker's call of the chip runtime, and the host's sampling of its lanes.

`WorkerProcess` (workers/main.py) runs each job it reads from the ring through `execute_job` and writes the
outcome as a result record; tests and tools run jobs through it in-process, without a worker.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from ipc.kv_slots import RecordRefused
from ipc.logprob_wants import asks_more
from ipc.records import Job, JobKind, JobStatus
from workers.backends.base import ChipBackend
from workers.constraints import ConstraintBook, ConstraintError
from workers.draft_model import DraftModel
from workers.job_imports import run_imports
from workers.kv_transfer import HostKv
from workers.lane_sampling import sample_lanes
from workers.logprob_alternatives import lane_alternatives, prompt_alternatives, prompt_lanes
from workers.multi_step import next_step
from workers.penalties import PenaltyBook, PenaltyError, count_looped, device_penalties
from workers.spec_verify import verify_drafts


@dataclass
class JobOutcome:
    """A finished job before it is written to the result ring."""

    status: JobStatus
    tokens: np.ndarray  # int32 [B], -1 where nothing was sampled
    logprobs: np.ndarray  # float32 [B]
    logits: np.ndarray | None  # [B, V] when the job asked for logits and the backend made them
    device_us: int
    error: str = ""
    masks: int = 0  # constrained lanes masked in this job (structured output)
    mask_us: int = 0  # time spent computing their masks
    accepted: np.ndarray | None = None  # verification jobs: accepted drafts per lane
    accepted_logprobs: np.ndarray | None = None
    accepted_tokens: np.ndarray | None = None
    extra: dict | None = None  # lanes asking for alternatives or prompt logprobs: JobResult's arrays by name


def execute_job(backend: ChipBackend, job: Job, extra_device_s: float = 0.0, host_kv: HostKv | None = None,
                constraints: ConstraintBook | None = None, draft: DraftModel | None = None,
                penalties: PenaltyBook | None = None) -> JobOutcome:
    """Run one job on the backend and sample its lanes.

    Inputs may be read-only ring views; nothing here writes to them.
    `extra_device_s` is the chaos "slow" hook: it is spent as device time.
    `constraints` masks the constrained lanes (structured output); a job with
    such lanes and no book fails.
    `draft`: the chip's draft model (speculative.draft_package): it proposes
    the drafts of `draft_src` lanes and mirrors every job's KV.
    `penalties`: the token counts of penalised lanes (workers/penalties.py);
    such lanes carry no drafts.
    """
    b = job.batch
    tokens = np.full(b, -1, np.int32)
    logprobs = np.zeros(b, np.float32)
    try:
        job.validate()
    except ValueError as exc:
        return JobOutcome(JobStatus.INVALID, tokens, logprobs, None, 0, f"invalid job: {exc}")
    if job.imports is not None:
        return _with_imports(backend, job, extra_device_s, host_kv, constraints, draft, penalties)
    t0 = time.perf_counter_ns()
    masks0, mask_us0 = (constraints.stats.masks, constraints.stats.mask_us) if constraints is not None else (0, 0)
    try:
        if extra_device_s > 0:
            time.sleep(extra_device_s)
        if job.kind == JobKind.KV_COPY:
            backend.copy_blocks(job.src_blocks, job.dst_blocks)
            if draft is not None:
                draft.copy_blocks(job.src_blocks, job.dst_blocks)
            return JobOutcome(JobStatus.OK, tokens, logprobs, None, (time.perf_counter_ns() - t0) // 1000)
        if job.kind in (JobKind.KV_EXPORT, JobKind.KV_IMPORT):
            if host_kv is None:
                return JobOutcome(JobStatus.INVALID, tokens, logprobs, None, 0, "no host KV pool attached")
            try:
                host_kv.run(job)
            except RecordRefused as exc:  # checked before any block was written: the device KV is untouched
                return JobOutcome(JobStatus.INVALID, tokens, logprobs, None, (time.perf_counter_ns() - t0) // 1000,
                                  f"import refused ({exc.cause}): {exc}")
            return JobOutcome(JobStatus.OK, tokens, logprobs, None, (time.perf_counter_ns() - t0) // 1000)
        penalised = job.penalties is not None and bool(job.penalties.active.any())
        if penalised and job.draft_lens.size and (job.penalties.active[job.draft_lens != 0] != 0).any():
            raise PenaltyError("a penalised lane cannot carry draft tokens")  # its counts would need each draft
        if penalised and penalties is None:
            raise PenaltyError("penalised lanes in a job run without a penalty book")
        if draft is None and device_loop_job(job):
            dev_pen = device_penalties(job, penalties) if penalised else None
            looped = backend.decode_steps(job, dev_pen) if penalised else backend.decode_steps(job)
            if looped is not None:  # None: no device loop (for these lanes), the host loop below
                if penalised:
                    count_looped(job, penalties, looped[0])
                return JobOutcome(JobStatus.OK, *looped, None, (time.perf_counter_ns() - t0) // 1000)
        if draft is not None and job.draft_src.size:
            job = draft.propose(job)
        lanes = np.flatnonzero((job.sample != 0) & (job.lane_valid != 0))
        drafted = constrained_draft_lanes(job, lanes)  # sampled under their draft rows' masks, in verify_drafts
        if drafted.size:
            if constraints is None:
                raise ConstraintError("constrained lanes in a job run without a constraint book")
            lanes = np.setdiff1d(lanes, drafted)
        masks = constraints.start(job, lanes, drafted) if job.constrained and constraints is not None else None
        try:
            out = backend.prefill(job) if job.kind == JobKind.PREFILL else backend.decode(job)
        finally:
            # never leave the helper on a dead job
            lane_masks, draft_masks = masks.result() if masks is not None else (None, None)
        device_us = (time.perf_counter_ns() - t0) // 1000
        accepted = accepted_lps = accepted_toks = None
        extra = None
        if out.logits is not None:
            if lanes.size:
                sample_lanes(job, out.logits, lanes, tokens, logprobs, constraints, lane_masks, penalties)
            if job.draft_lens.size:
                if out.draft_logits is None:
                    raise RuntimeError("the backend cannot verify draft tokens (no draft_logits)")
                if drafted.size and draft_masks is None:
                    draft_masks = constraints.draft_masks(job, drafted, out.logits.shape[1])
                accepted, accepted_lps, accepted_toks = verify_drafts(job, out.draft_logits, tokens, logprobs,
                                                                      draft_masks, out.logits)
            if asks_more(job.want_logprobs):
                extra = logprob_arrays(job, out, lanes)
        elif out.tokens is not None:
            if job.constrained and (job.constraint_id[lanes].any() or drafted.size):
                raise ConstraintError("this backend samples on the device: constrained lanes need logits")
            if penalised and job.penalties.active[lanes].any():
                raise PenaltyError("this backend samples on the device: penalised lanes need logits")
            tokens[lanes] = out.tokens[lanes]
        else:
            raise RuntimeError("backend returned neither logits nor tokens")
        if draft is not None:
            draft.mirror(job)
        if job.kind == JobKind.DECODE and job.decode_steps > 1:
            # multi-step decode, the host loop (no device loop for this job or backend): the next steps on
            # this worker, each fed the token the step before sampled
            steps = [tokens]
            lp_steps = [logprobs]
            step = job
            for _ in range(job.decode_steps - 1):
                step = next_step(step, steps[-1])
                t, lp = np.full(b, -1, np.int32), np.zeros(b, np.float32)
                _step_tokens(step, backend.decode(step), lanes, t, lp, penalties)
                if draft is not None:
                    draft.mirror(step)
                steps.append(t)
                lp_steps.append(lp)
            tokens, logprobs = np.stack(steps, axis=1), np.stack(lp_steps, axis=1)
            device_us = (time.perf_counter_ns() - t0) // 1000
        # last: a job that fails before this leaves the matchers as before it (its fed drafts rolled back by
        # the lane's next job), so its retry feeds the same tokens
        for lane, dm in (draft_masks or {}).items():
            constraints.settle(dm, int(accepted[lane]))
    except Exception as exc:  # a device-level fault fails this job, never the worker
        return JobOutcome(JobStatus.FAILED, np.full(b, -1, np.int32), np.zeros(b, np.float32), None,
                          (time.perf_counter_ns() - t0) // 1000, f"{type(exc).__name__}: {exc}")
    logits = out.logits if job.return_logits else None
    spec = dict(accepted=accepted, accepted_logprobs=accepted_lps, accepted_tokens=accepted_toks, extra=extra)
    if job.constrained and constraints is not None:
        st = constraints.stats
        return JobOutcome(JobStatus.OK, tokens, logprobs, logits, device_us, masks=st.masks - masks0,
                          mask_us=st.mask_us - mask_us0, **spec)
    return JobOutcome(JobStatus.OK, tokens, logprobs, logits, device_us, **spec)


def _with_imports(backend: ChipBackend, job: Job, extra_device_s: float, host_kv: HostKv | None,
                  constraints: ConstraintBook | None, draft: DraftModel | None,
                  penalties: PenaltyBook | None) -> JobOutcome:
    """A prefill job carrying tier imports: they first (a refused lane is taken out of the job), then the rest;
    the result says per lane which were refused."""
    b = job.batch
    t0 = time.perf_counter_ns()
    try:
        job, refused, why = run_imports(job, host_kv)
    except Exception as exc:  # a device-level fault while writing: the job fails, its lanes' KV unknown
        return JobOutcome(JobStatus.FAILED, np.full(b, -1, np.int32), np.zeros(b, np.float32), None,
                          (time.perf_counter_ns() - t0) // 1000, f"{type(exc).__name__}: {exc}")
    if job.lane_valid.any():
        out = execute_job(backend, dataclasses.replace(job, imports=None), extra_device_s, None, constraints, draft,
                          penalties)
    else:  # every lane's import was refused: nothing left to run
        out = JobOutcome(JobStatus.OK, np.full(b, -1, np.int32), np.zeros(b, np.float32), None,
                         (time.perf_counter_ns() - t0) // 1000)
    if out.status == JobStatus.OK:
        out.extra = {**(out.extra or {}), "refused": refused}
        if why:
            out.error = "; ".join(why)
    return out


def logprob_arrays(job: Job, out, lanes: np.ndarray) -> dict | None:
    """The result arrays of the lanes asking for alternatives or prompt logprobs (one-step jobs only: the
    scheduler keeps such lanes out of multi-step and speculative jobs)."""
    arrays = {}
    if job.decode_steps == 1:
        tops = lane_alternatives(job, out.logits, lanes)
        if tops is not None:
            arrays["top_ids"], arrays["top_logprobs"] = tops
    if prompt_lanes(job):
        lps, starts, ids, tlps = prompt_alternatives(job, out.prompt_logits)
        arrays["prompt_logprobs"], arrays["prompt_start"] = lps, starts
        if ids is not None:
            arrays["prompt_top_ids"], arrays["prompt_top_logprobs"] = ids, tlps
    return arrays or None


def constrained_draft_lanes(job: Job, lanes: np.ndarray) -> np.ndarray:
    """The constrained lanes among `lanes` that carry drafts (their every row is sampled under its own mask)."""
    if not job.constrained or not job.draft_lens.size:
        return np.zeros(0, np.int64)
    return lanes[(job.draft_lens[lanes] != 0) & (job.constraint_id[lanes] != 0)]


def device_loop_job(job: Job) -> bool:
    """Whether a job's steps may all run on the device (`ChipBackend.decode_steps`): a multi-step decode
    whose every valid lane samples, with nothing the host must do between steps: no constrained lane (its
    mask is the host's), no draft tokens, and no logits to return. Penalised lanes go too when the backend's
    loop takes penalties (else it declines and the host loop runs). The worker also keeps the host loop when
    it has a draft model (it mirrors every step's KV)."""
    return (job.kind == JobKind.DECODE and job.decode_steps > 1 and not job.constrained and not job.draft_lens.size
            and not job.return_logits and not asks_more(job.want_logprobs) and bool(np.array_equal(job.sample != 0, job.lane_valid != 0)))


def _step_tokens(job: Job, out, lanes: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                 penalties: PenaltyBook | None = None) -> None:
    """One step's tokens into `tokens`/`logprobs`: sampled from its logits, or as the backend chose them."""
    if out.logits is not None:
        if lanes.size:
            sample_lanes(job, out.logits, lanes, tokens, logprobs, penalties=penalties)
    elif out.tokens is not None:
        tokens[lanes] = out.tokens[lanes]
    else:
        raise RuntimeError("backend returned neither logits nor tokens")
