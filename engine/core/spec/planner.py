"""Which decode lanes speculate in a job, how many drafts each carries, and the counters.

Per request: `GenerateParams.speculative` ("off" | "ngram" | "draft", None =
the board default `speculative.method`; "draft" without a draft model on the
board decodes plainly). Per job: no drafts once the job has more than
`max_batch_lanes` decode lanes -- a large batch already keeps the chip
compute-bound, where verifying k extra positions per lane costs more than
the passes it saves. Per lane: k from `CostK` (`k_choice = "cost"`: the
most expected tokens per unit of the measured step cost, `StepCost`) or
`AdaptiveK` (`"adaptive"`: the acceptance schedule), capped so that the run
never passes max_tokens or max_seq (a stop inside the accepted run is still
cut by the stop checker, token by token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.spec.adaptive import AdaptiveK
from engine.core.spec.cost_k import CostK
from engine.core.spec.ngram_draft import NgramDrafter
from engine.core.spec.step_cost import StepCost

METHODS = ("off", "ngram", "draft")
K_CHOICES = ("cost", "adaptive")


@dataclass
class SpecLane:
    """One request's drafting state (kept on its RequestRecord)."""

    drafter: NgramDrafter
    k: AdaptiveK | CostK


@dataclass
class SpecCounters:
    """vLLM's spec_decode_* figures: drafts, draft tokens, accepted tokens, accepted per position."""

    drafts: int = 0  # verification steps (lanes that carried drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted + the token after them, over verification steps
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: steps whose draft i was accepted
    # acceptance-rate histogram: steps whose accepted/drafted fell in [i/10, (i+1)/10) (1.0 in the last)
    rate_buckets: list[int] = field(default_factory=lambda: [0] * 10)
    constrained_drafts: int = 0  # of `drafts`, on constrained lanes (structured output)
    constrained_accepted_tokens: int = 0  # of `accepted_tokens`, on constrained lanes

    def observe(self, drafted: int, accepted: int, constrained: bool = False) -> None:
        if constrained:
            self.constrained_drafts += 1
            self.constrained_accepted_tokens += accepted
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        self.rate_buckets[min(9, int(10 * accepted / drafted))] += 1

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted_tokens,
            "num_emitted_tokens": self.emitted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "tokens_per_step": self.emitted_tokens / self.drafts if self.drafts else None,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate_buckets": list(self.rate_buckets),
            "constrained": {"num_drafts": self.constrained_drafts,
                            "num_accepted_tokens": self.constrained_accepted_tokens},
        }


class SpecPlanner:
    def __init__(self, method: str, max_draft_tokens: int, max_batch_lanes: int, verify: bool,
                 ngram_min: int = 1, ngram_max: int = 3, draft_model: bool = False, k_choice: str = "cost") -> None:
        if method not in METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(METHODS)}")
        if k_choice not in K_CHOICES:
            raise ValueError(f"speculative.k_choice must be one of {', '.join(K_CHOICES)}")
        self.k_choice = k_choice
        self.step_cost = StepCost()
        self.method = method
        self.max_draft_tokens = max_draft_tokens
        self.max_batch_lanes = max_batch_lanes
        self.verify = verify  # the backend returns draft rows (describe().extra["spec_verify"])
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.draft_model = draft_model  # the workers run a draft model (describe().extra["spec_draft"])
        self.counters = SpecCounters()

    def method_for(self, requested: str | None) -> str:
        method = self.method if requested is None else requested
        if not self.verify or self.max_draft_tokens <= 0 or (method == "draft" and not self.draft_model):
            return "off"
        return method

    def wants(self, requested: str | None) -> bool:
        return self.method_for(requested) != "off"

    def drafts(self, r, decode_lanes: int, room: int) -> tuple[list[int], bool]:
        """(draft tokens for request record `r` this step, at most `room`; from the draft model).

        ([], False) = a plain decode lane. Draft-model drafts are placeholders
        (the lane's last token repeated) that the worker's draft model fills.
        """
        if room <= 0 or decode_lanes > self.max_batch_lanes:
            return [], False
        method = self.method_for(r.params.speculative)
        if method == "off" or r.params.penalties is not None or r.params.top_logprobs:
            # penalties: not drafted (their counts would need each draft); alternatives come from one-step jobs
            # only. Structured output drafts: the worker masks each draft row (workers/masked_verify.py).
            return [], False
        lane = r.spec
        if lane is None:
            choose = CostK if self.k_choice == "cost" else AdaptiveK
            lane = r.spec = SpecLane(NgramDrafter(self.ngram_min, self.ngram_max), choose(self.max_draft_tokens))
        p = r.params
        left = p.max_tokens - len(p.continuation) - r.generated - 1  # tokens after the one this step samples
        if isinstance(lane.k, CostK):
            if self.step_cost.wants_plain(decode_lanes):  # measure the plain step the cost is relative to
                return [], False
            want = lane.k.next_k(lambda k: self.step_cost.cost(k, decode_lanes))
        else:
            want = lane.k.next_k()
        k = min(want, room, left)
        if k <= 0:
            return [], False
        if method == "draft":
            return [r.tokens[-1]] * k, True
        return lane.drafter.propose(r.tokens, k), False

    def on_job(self, lanes: int, drafts: int, device_us: int) -> None:
        """A decode job's backend time (no prompt in it): what a step costs with `drafts` draft tokens."""
        self.step_cost.observe(lanes, drafts, device_us)

    def observe(self, r, drafted: int, accepted: int) -> None:
        if r.spec is not None:
            r.spec.k.observe(drafted, accepted)
        self.counters.observe(drafted, accepted, r.params.constraint is not None)


def draft_room(committed: int, reserved: int, max_seq: int) -> int:
    """Drafts a lane can carry within its reservation (its last token takes one position)."""
    return min(reserved, max_seq) - committed - 1
