"""What a verification step costs, in plain decode steps, measured from the chip's own jobs.

Verifying k drafts runs k+1 positions per lane through the model; on a chip
where a step is bound by the weights' pass that is nearly free, on a CPU
where the LM head (262k rows on Gemma) is computed per position it costs
almost k+1 steps. So the cost is measured, not assumed: every decode job's
backend time (`JobResult.device_us`) is kept per (decode lanes, drafts in
the job) as a running mean, and the cost of one more draft per lane is the
slope of those means over the plain step of the same lane count. Until a
pair is measured, `PRIOR_PER_DRAFT` stands in. Lanes that always draft
would never measure the plain step, so a job of a lane count whose plain
step has fewer than `MIN_JOBS` jobs, or none in the last `REFRESH` jobs,
goes plain (`wants_plain`): a few steps in hundreds, and only once the
backend has reported a job's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_PER_DRAFT = 0.1  # decode steps per draft token before anything is measured (cheap: speculation is tried)
EWMA = 0.2  # weight of the newest job in a running mean
MIN_JOBS = 3  # jobs of a (lanes, drafts) pair before its mean counts
REFRESH = 256  # decode jobs of a lane count after which its plain step is measured again


@dataclass
class StepCost:
    prior_per_draft: float = PRIOR_PER_DRAFT
    _mean_us: dict[tuple[int, int], float] = field(default_factory=dict)  # (lanes, drafts) -> running mean
    _jobs: dict[tuple[int, int], int] = field(default_factory=dict)
    _since_plain: dict[int, int] = field(default_factory=dict)  # lanes -> decode jobs since its last plain one

    def observe(self, lanes: int, drafts: int, device_us: int) -> None:
        """One decode job of `lanes` lanes carrying `drafts` draft tokens in all took `device_us`."""
        if lanes <= 0 or device_us <= 0:
            return
        key = (lanes, drafts)
        m = self._mean_us.get(key)
        self._mean_us[key] = float(device_us) if m is None else (1 - EWMA) * m + EWMA * device_us
        self._jobs[key] = self._jobs.get(key, 0) + 1
        self._since_plain[lanes] = 0 if drafts == 0 else self._since_plain.get(lanes, 0) + 1

    def wants_plain(self, lanes: int) -> bool:
        """The next job of `lanes` decode lanes should carry no drafts: its plain step is not measured (yet,
        or for `REFRESH` jobs)."""
        if not self._jobs:  # the backend reports no times (or none yet): nothing to measure against
            return False
        return self._jobs.get((lanes, 0), 0) < MIN_JOBS or self._since_plain.get(lanes, 0) >= REFRESH

    def _measured(self, key: tuple[int, int]) -> float | None:
        return self._mean_us[key] if self._jobs.get(key, 0) >= MIN_JOBS else None

    def per_draft(self, lanes: int) -> float:
        """Decode steps one more draft per lane adds, for a job of `lanes` lanes: the slope of the measured
        means over the plain step (the nearest lane count that has both), else the prior."""
        plain_lanes = sorted((n for (n, d) in self._mean_us if d == 0 and self._measured((n, 0))),
                             key=lambda n: abs(n - lanes))
        for n in plain_lanes:
            base = self._measured((n, 0))
            slopes = [(t / base - 1.0) * n / d for (m, d) in self._mean_us
                      if m == n and d > 0 and (t := self._measured((m, d))) is not None]
            if slopes:
                return max(0.0, sum(slopes) / len(slopes))
        return self.prior_per_draft

    def cost(self, k: int, lanes: int = 1) -> float:
        """A step's cost in plain decode steps when each of `lanes` lanes carries `k` drafts."""
        return 1.0 + self.per_draft(lanes) * k

    def table(self, lanes: int = 1, max_k: int = 8) -> dict:
        """The measured cost at k = 1..max_k drafts for one lane count (None: not measured), and the slope."""
        base = self._measured((lanes, 0))
        measured = {}
        for k in range(1, max_k + 1):
            t = self._measured((lanes, k * lanes))
            measured[str(k)] = None if t is None or not base else round(t / base, 3)
        return {"lanes": lanes, "plain_step_us": None if base is None else round(base, 1),
                "cost_in_steps": measured, "per_draft": round(self.per_draft(lanes), 4)}


def decode_shape(lanes: int, start_lens: list[int], new_lens: list[int], drafts: list[list[int]] | None,
                 steps: int) -> tuple[int, int] | None:
    """(decode lanes, draft tokens) of a one-step job of decode lanes only; None when a prompt chunk or more
    than one step rides in it (its time says nothing of a verification step's cost)."""
    if steps != 1 or lanes <= 0:
        return None
    n_drafts = sum(map(len, drafts)) if drafts else 0
    positions = sum(e - s for s, e in zip(start_lens, new_lens))
    return (lanes, n_drafts) if positions == lanes + n_drafts else None
