"""Jobs grouped by adapter, for backends that apply one adapter set per job (llama.cpp sets adapters per
context), with a bounded wait so adapters do not starve each other.

A job's lanes all run one adapter (or all the base model: the base is a group
too). The group is the first chosen lane's, so the usual order decides (the
decode round robin, tenant shares, the prefill queues); lanes of other groups
are deferred, in order. A group whose lanes were deferred for `max_wait_jobs`
jobs of the chip in a row is forced as the next job's group, so a waiting
adapter's lanes get a job within a bounded number of jobs even when another
group's lanes are always first in line.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_WAIT_JOBS = 4


class AdapterGroups:
    def __init__(self, max_wait_jobs: int = MAX_WAIT_JOBS) -> None:
        self.max_wait_jobs = max_wait_jobs
        self.waited: dict[int, dict[int, int]] = {}  # chip -> {group: jobs it was deferred in a row}

    def forced(self, chip: int) -> int | None:
        """The group the chip's next job must run (the longest overdue), or None: the first lane's."""
        w = self.waited.get(chip)
        if not w:
            return None
        group, jobs = max(w.items(), key=lambda kv: (kv[1], -kv[0]))
        return group if jobs >= self.max_wait_jobs else None

    def split(self, lanes: Sequence, group: int | None) -> tuple[int | None, list, list]:
        """(the job's group, its lanes, the deferred lanes): `group` None takes the first lane's."""
        if group is None and lanes:
            group = lanes[0].params.adapter
        kept = [r for r in lanes if r.params.adapter == group]
        return group, kept, [r for r in lanes if r.params.adapter != group]

    def ran(self, chip: int, group: int | None, deferred: Sequence) -> None:
        """A job of `group` went (None: no job); the deferred lanes' groups waited one more job."""
        w = self.waited.setdefault(chip, {})
        if group is not None:
            w.pop(group, None)
        for g in {r.params.adapter for r in deferred} - {group}:
            w[g] = w.get(g, 0) + 1

    def forget(self, chip: int, group: int) -> None:
        """The forced group had no lane to run (its requests ended): stop forcing it."""
        self.waited.get(chip, {}).pop(group, None)
