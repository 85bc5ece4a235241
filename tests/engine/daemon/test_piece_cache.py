"""The daemon's cache of token bytes (`model.piece_cache_entries`): bounded, counted, and 0 means none."""

from __future__ import annotations

from engine.daemon.text_io import DEFAULT_PIECE_CACHE_ENTRIES, piece_cache_stats, piece_function
from workers.tokenizer import ByteTokenizer


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__(300)
        self.asked = 0

    def piece(self, token_id: int) -> bytes:
        self.asked += 1
        return super().piece(token_id)


def test_the_cache_keeps_at_most_its_bound_and_counts_hits_and_misses():
    tok = CountingTokenizer()
    piece = piece_function(tok, 4)
    for t in [65, 66, 65, 66] + list(range(70, 80)) + [79]:
        assert piece(t) == bytes([t])
    assert piece_cache_stats(piece) == {"entries": 4, "max_entries": 4, "hits": 3, "misses": 12}
    assert tok.asked == 12


def test_zero_entries_asks_the_tokenizer_every_time():
    tok = CountingTokenizer()
    piece = piece_function(tok, 0)
    for _ in range(3):
        assert piece(65) == b"A"
    assert piece_cache_stats(piece) == {"entries": 0, "max_entries": 0, "hits": 0, "misses": 3}
    assert tok.asked == 3


def test_the_default_bound_is_the_config_default():
    from engine.config import load_config

    assert DEFAULT_PIECE_CACHE_ENTRIES == load_config(None, {}).model.piece_cache_entries == 1024
    assert piece_cache_stats(None) is None
