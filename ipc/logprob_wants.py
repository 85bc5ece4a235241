"""What a job lane asks of log-probabilities, packed in its `want_logprobs` byte.

One byte per lane already travels in every job, so asking for alternatives or
for the prompt's log-probabilities costs no new job field and no ring bytes for
the lanes that do not ask:

* bits 0-4: 0 = none, 1 = the chosen token's log-probability, 1 + k = also the
  k most likely tokens of the same distribution (k <= MAX_TOP);
* bit 7 (PROMPT): also, for each input token of the lane after its first, its
  log-probability given the tokens before it and the top k there (a prefill
  lane; the backend must make the logits of those rows).

A value of 0 or 1 means what it always meant, so older senders stay valid.
"""

from __future__ import annotations

import numpy as np

MAX_TOP = 20  # vLLM's and OpenAI's cap on alternatives per token
TOP_MASK = 0x1F
PROMPT = 0x80


def want_code(logprobs: bool, top: int = 0, prompt: bool = False) -> int:
    """The lane byte for a request asking `logprobs` (with `top` alternatives) and/or its prompt's."""
    assert 0 <= top <= MAX_TOP
    code = (1 + top) if (logprobs or top or prompt) else 0
    return code | PROMPT if prompt else code


def top_count(code: int) -> int:
    """The alternatives a lane byte asks for (0: none)."""
    return max(0, (int(code) & TOP_MASK) - 1)


def top_counts(codes: np.ndarray) -> np.ndarray:
    """`top_count` of every lane byte at once (int64)."""
    return np.maximum((np.asarray(codes).astype(np.int64) & TOP_MASK) - 1, 0)


def asks_more(codes: np.ndarray) -> bool:
    """Whether any lane asks for alternatives or prompt log-probabilities (the rare path)."""
    return bool(codes.size) and int(codes.max()) > 1
