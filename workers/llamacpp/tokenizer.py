"""llama.cpp's own tokenizer for GGUF packages (a vocab-only load: no weights, no context).

`encode` is `llama_tokenize` with `add_special` as the model's metadata says
(BOS for Gemma and Llama), and special-token text in the input is treated as
plain text, so a user cannot forge control tokens. `piece` is
`llama_token_to_piece` without special tokens: the bytes a token adds to
the output text (b"" for BOS/EOS/control tokens). No hand-written BPE.

Nothing is cached per token here: llama.cpp answers from its own table, and
a dict filled as tokens are first seen grows with every new token of a
262,144-id vocabulary (the daemon keeps a bounded cache of its own,
`model.piece_cache_entries`).
"""

from __future__ import annotations

from workers.llamacpp.binding import LlamaModel


class GgufTokenizer:
    """The `workers.tokenizer.Tokenizer` protocol over a GGUF's vocabulary. Not thread-safe."""

    def __init__(self, gguf_path: str) -> None:
        self._model = LlamaModel(gguf_path, vocab_only=True)
        info = self._model.info
        self.vocab_size: int = info["n_vocab"]
        self.bos_id: int = info["bos"]
        self.eos_id: int = info["eos"]
        self.add_bos: bool = bool(info["add_bos"])

    def encode(self, text: str) -> list[int]:
        return self._model.tokenize(text, add_special=True, parse_special=False)

    def encode_template(self, text: str) -> list[int]:
        """A rendered chat template: its special-token text (`<start_of_turn>`) becomes the control tokens,
        and no BOS is added (the template writes `bos_token` itself)."""
        return self._model.tokenize(text, add_special=False, parse_special=True)

    def token_text(self, token_id: int) -> str:
        """A token's text with special tokens spelled out (`<bos>`): what a chat template calls bos_token."""
        return self._model.piece(token_id, special=True).decode("utf-8", errors="replace")

    def special_piece(self, token_id: int) -> bytes:
        """A token's bytes with special tokens spelled out (b"<eos>"): how a grammar library names them."""
        return self._model.piece(token_id, special=True)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of raw bytes, no BOS, special-token text as plain text (a grammar library's tokenize)."""
        return self._model.tokenize(data, add_special=False, parse_special=False)

    def piece(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside 0..{self.vocab_size - 1}")
        return self._model.piece(token_id, special=False)

    def decode(self, token_ids) -> str:
        """All pieces joined and decoded (invalid UTF-8 replaced): for tests and tools."""
        return b"".join(self.piece(int(t)) for t in token_ids).decode("utf-8", errors="replace")

    def close(self) -> None:
        self._model.close()
