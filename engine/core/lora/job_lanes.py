"""Which lanes a job may take when they run LoRA adapters: the job builder's one seam for adapters.

Two rules, by what the backend can run in one job (`ModelSpec.lora_mixed`):

* mixed (ref, ctypes): lanes of at most `lora_slots` adapters share a job
  (`job_adapters.within_slots`);
* grouped (llamacpp: one adapter set per context): every lane of a job runs
  one adapter, or the base model (`adapter_groups.AdapterGroups`: the first
  lane's group, or one deferred too long).

Lanes left out wait for a later job, in order: decode lanes stay ready, prompt
chunks go back to the front of their queues. A mixed job (decode lanes and
prompt chunks) is decided in steps: `begin_mixed`, `decode`, `prompts`, then
`end_mixed`, which records the job's group and what it deferred.
"""

from __future__ import annotations

from engine.core.lora.adapter_groups import AdapterGroups
from engine.core.lora.job_adapters import within_slots


class AdapterLanes:
    def __init__(self) -> None:
        self.groups = AdapterGroups()
        self._group: int | None = None  # the mixed job being built: its group so far
        self._deferred: list = []  # and the lanes it left out

    def decode(self, model, chip: int, lanes: list, mixed_job: bool = False) -> list:
        """The decode lanes the job takes."""
        if model.lora_mixed:
            return within_slots(lanes, model.lora_slots)[0]
        if mixed_job:  # the job's end records the group (end_mixed)
            group, kept, deferred = self.groups.split(lanes, self._group)
            self._group = group if kept else self._group
            self._deferred += deferred
            return kept
        forced = self.groups.forced(chip)
        group, kept, deferred = self.groups.split(lanes, forced)
        if forced is not None and not kept:
            self.groups.forget(chip, forced)  # nothing of it to decode here: choose freely
            group, kept, deferred = self.groups.split(lanes, None)
        self.groups.ran(chip, group if kept else None, deferred)
        return kept

    def prefill(self, model, chip: int, r) -> None:
        """A prefill job of one request ran (grouped: its group ran)."""
        if not model.lora_mixed:
            self.groups.ran(chip, r.params.adapter, [])

    def begin_mixed(self, model, chip: int) -> None:
        if not model.lora_mixed:
            self._group, self._deferred = self.groups.forced(chip), []

    def prompts(self, model, queues, decode: list, prompts: list) -> tuple[list, int]:
        """(the prompt chunks the job keeps beside its decode lanes, the tokens of those put back); the others
        go back to the front of their queues, in order."""
        if model.lora_mixed:
            seen: set[int] = set()
            within_slots(decode, model.lora_slots, seen)
            kept, deferred = within_slots([r for r, _, _ in prompts], model.lora_slots, seen)
        else:  # one group per job: the decode lanes' (or the forced one), else the first prompt's
            group = decode[0].params.adapter if decode else self._group
            group, kept, deferred = self.groups.split([r for r, _, _ in prompts], group)
            self._deferred += deferred
        if not deferred:
            return prompts, 0
        for r in reversed(deferred):
            queues.push(r.request_id, r.prefill_target - r.committed, front=True)
        keep = {id(r) for r in kept}
        out = [p for p in prompts if id(p[0]) in keep]
        return out, sum(e - s for _, s, e in prompts) - sum(e - s for _, s, e in out)

    def end_mixed(self, model, chip: int, decode: list, prompts: list) -> bool:
        """Record the mixed job's group; True when the forced group had nothing to run (plan again, freely)."""
        if model.lora_mixed:
            return False
        if not decode and not prompts and self.groups.forced(chip) is not None:
            self.groups.forget(chip, self.groups.forced(chip))
            return True
        first = decode[0] if decode else (prompts[0][0] if prompts else None)
        self.groups.ran(chip, None if first is None else first.params.adapter, self._deferred)
        return False
