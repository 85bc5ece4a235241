"""Prompt-lookup (n-gram) drafts: propose what followed the last n tokens the last time they occurred.

Model-free (vLLM's `ngram`, llama.cpp's `--spec-type ngram-*`): when the
output copies the prompt or itself (editing a file, summarising, code), the
tokens that followed an earlier occurrence of the current suffix are a good
guess, and a wrong guess only costs verification work, never correctness.

The index is incremental: a request's tokens only ever grow (rejected drafts
never enter them), so each new token is indexed once, O(max_n) per token,
and a proposal is O(max_n) dict look-ups instead of a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramDrafter:
    """One request's n-gram index over its tokens (prompt + output)."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        # n -> {n-gram: index just past its latest occurrence that has a continuation}
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams ending before this index are in the tables

    def _index(self, tokens: Sequence[int]) -> None:
        # An n-gram ending at i-1 (so its continuation starts at i) is indexed once token i exists.
        end = len(tokens) - 1
        for i in range(max(self._indexed, 1), end + 1):
            for n, table in self._last.items():
                if i >= n:
                    table[tuple(tokens[i - n:i])] = i
        self._indexed = max(self._indexed, end + 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (empty when no suffix of min_n..max_n tokens recurs)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        self._index(tokens)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            at = self._last[n].get(tuple(tokens[size - n:]))
            if at is not None:
                return list(tokens[at:min(at + k, size)])
        return []
