"""The LoRA adapters' metric families: adapters on each chip, swaps and their time, requests and tokens per adapter.

Adapter names are label values only for adapters the board loaded (the
config or an admin op), never for a name a request made up, so the label
cardinality is bounded by `lora.max_adapters`.
"""

from __future__ import annotations

from typing import Protocol


class Builder(Protocol):
    def add(self, kind: str, name: str, doc: str, labels: tuple[str, ...], samples) -> None: ...


def lora_families(b: Builder, st: dict) -> None:
    """`st`: `LoraRegistry.stats()`."""
    chips = st["chips"]

    def per_chip(key: str):
        return [((str(c["generation"]), str(c["chip"])), c.get(key, 0)) for c in chips]

    b.add("gauge", "lora_adapters_loaded", "LoRA adapters in each chip's device slots.", ("generation", "chip"),
          per_chip("loaded"))
    b.add("counter", "lora_swaps", "Adapters swapped into a chip's device slots (read or taken from the host "
          "cache, then loaded).", ("generation", "chip"), per_chip("swaps"))
    b.add("counter", "lora_swap_seconds", "Time chips spent swapping adapters in.", ("generation", "chip"),
          per_chip("swap_s"))
    adapters = st["adapters"]
    b.add("counter", "lora_requests", "Requests admitted under each loaded adapter.", ("adapter",),
          [((n,), a["requests"]) for n, a in adapters.items()])
    b.add("counter", "lora_tokens", "Tokens generated under each loaded adapter (counted when a request ends).",
          ("adapter",), [((n,), a["tokens"]) for n, a in adapters.items()])
    b.add("gauge", "lora_adapters", "LoRA adapters loaded on the board.", (), [((), st["loaded"])])
