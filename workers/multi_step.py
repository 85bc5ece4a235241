"""Multi-step decode on the worker (`executor.decode_steps`): the job of the next step.

A decode job with `decode_steps = n` runs n steps before the worker answers,
so the host's per-step round trip (result, sampling, stop checks, the next
job) is paid once per n tokens. Step k+1 is step k with every valid lane one
position on and fed the token step k sampled; sampling stays deterministic
per (seed, position). The worker stops no lane early: the scheduler, which
knows each request's EOS, stop ids, stop strings and max_tokens, keeps each
lane's tokens up to its end and rolls back the KV written past it (and only
asks for as many steps as the closest max_tokens allows).

This is the host loop. A backend with a device loop (`ChipBackend.decode_steps`:
the C ABI's `simpler_model_decode_steps_paged`) runs the same steps and the
same sampler on the device in one call instead, for the jobs
`workers.execute_job.device_loop_job` lets it take.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ipc.records import Job


def next_step(job: Job, sampled: np.ndarray) -> Job:
    """`job` one position on: its valid lanes' input tokens are `sampled` ([B], this step's tokens)."""
    valid = job.lane_valid != 0
    ctx = np.asarray(job.context_lens)
    pen = job.penalties
    if pen is not None:  # one more output token before each lane's sample (the penalty book counts its input)
        pen = dataclasses.replace(pen, done=np.asarray(pen.done, dtype=np.int32) + 1,
                                  rebuild=np.zeros_like(pen.rebuild))
    return dataclasses.replace(
        job,
        tokens=np.ascontiguousarray(sampled[valid], dtype=np.int32),
        positions=np.asarray(job.positions, dtype=np.int32) + 1,
        context_lens=np.where(valid, ctx + 1, 0).astype(np.int32),
        penalties=pen,
    )
