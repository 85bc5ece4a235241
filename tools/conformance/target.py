"""What the suite needs to know about the endpoint before it checks anything, learned from `health`.

A daemon and a balancer answer `health` with different bodies
(protocol.md vs balancer.md): a balancer's has `backends_up`. The served
model's `vocab_size`, `max_seq` and `text` (whether it has a tokenizer) pick
prompts that are valid and requests long enough to be cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Target:
    kind: str  # "daemon" or "balancer"
    health: dict
    vocab_size: int
    max_seq: int
    text: bool  # the default model has a tokenizer: every generate gets `text`

    def prompt(self, seed: int, n: int = 6) -> list[int]:
        """A short valid prompt, different per seed; ids in the byte range when the vocabulary allows."""
        top = min(self.vocab_size, 256)
        return [(seed * 7919 + i * 104729 + 33) % (top - 1) + 1 for i in range(n)]

    def long_max_tokens(self, prompt_len: int) -> int:
        """As many tokens as the context allows (capped at 4096): a request that is still running when cancelled."""
        return max(1, min(4096, self.max_seq - prompt_len - 1))


def target_from_health(health: dict, kind: str = "auto") -> Target:
    if kind == "auto":
        kind = "balancer" if "backends_up" in health else "daemon"
    model = health.get("model") or {}
    vocab = model.get("vocab_size")
    max_seq = model.get("max_seq")
    if not isinstance(vocab, int) or not isinstance(max_seq, int):
        raise ValueError("health.model has no integer vocab_size/max_seq (no default model loaded? "
                         f"health.model = {model!r})")
    return Target(kind, health, vocab, max_seq, bool(model.get("text")))
