"""One sequence alone in llama.cpp, greedy: the reference run.

Golden cases of imported GGUF packages are made by it, and the tests hold
the `llamacpp` backend under batching, prefix reuse and preemption to it.
It issues exactly the calls a lone request makes through the backend (the
whole prompt in one `llama_decode`, then one token per call), so the kernels
see the same shapes.
"""

from __future__ import annotations

import numpy as np

from workers.llamacpp.binding import LlamaModel


def greedy_solo(model: LlamaModel, prompt: list[int], max_tokens: int, *, seq: int = 0,
                stop_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
    """Greedy tokens (lowest id on ties) and the top-1/top-2 logit gap at each; clears `seq` first and after."""
    model.seq_rm(seq, -1, -1)
    try:
        toks = np.asarray(prompt, np.int32)
        pos = np.arange(len(toks), dtype=np.int32)
        out, gaps = [], []
        for _ in range(max_tokens):
            want = np.zeros(len(toks), np.int8)
            want[-1] = 1
            rc, logits = model.decode(toks, pos, np.full(len(toks), seq, np.int32), want)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            row = logits[0]
            t = int(np.argmax(row))
            top2 = np.partition(row, -2)[-2:]
            out.append(t)
            gaps.append(float(top2[1] - top2[0]))
            if t in stop_ids:
                break
            pos = np.array([pos[-1] + 1], np.int32)
            toks = np.array([t], np.int32)
        return out, gaps
    finally:
        model.seq_rm(seq, -1, -1)


# A greedy token may differ from the solo run only where the solo run's top-2 logit gap is below this:
# llama.cpp's kernels round differently for other batch shapes, which can flip an (almost) exact tie.
TOP2_EPSILON = 0.1


def compare_greedy(got: list[int], want: list[int], gaps: list[float], eps: float = TOP2_EPSILON) -> str:
    """'same', 'near-tie' (first difference where the solo gap < eps: allowed, to be counted) or 'differs'."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return "near-tie" if gaps[i] < eps else "differs"
    return "same" if len(got) == len(want) else "differs"
