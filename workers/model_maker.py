"""The random-weight `.npz` model package with golden cases (`npuserve make-model`, tools/make_model_cmd.py).

Weights are random with a scaled init so that greedy decoding wanders over
the vocabulary instead of repeating one token, and logits have a spread of
about `logit_std`. Golden cases are computed by the cache-free full
recompute (`Transformer.dense_logits`), never by the paged path they check;
prompts whose greedy choice is a near-tie (top-2 gap < GOLDEN_MIN_GAP) are
redrawn so that float rounding differences between correct implementations
cannot flip a golden token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from workers.model_package import ARCHITECTURE, WEIGHTS
from workers.package_manifest import GOLDEN, SCHEMA, package_folder, write_manifest
from workers.transformer import ModelDims, Transformer, weight_shapes

# Bump when this maker changes what a given default_model.json produces, so
# cached default packages built by older code are not reused (workers.default_package).
MAKER_VERSION = 2  # 2: the manifest's tokenizer section is {"kind": ...}
GOLDEN_MIN_GAP = 1e-2
_PROMPT_LENGTHS = (1, 15, 16, 17, 33, 7, 48, 3)


def _special_ids(vocab: int) -> tuple[int, list[int], int]:
    """bos, eos_ids, pad: byte-level layout (256=bos, 257=eos, 258=pad) when the vocab allows."""
    if vocab >= 259:
        return 256, [257], 258
    if vocab < 4:
        raise ValueError("vocab must be at least 4")
    return vocab - 3, [vocab - 2], vocab - 1


def _random_weights(dims: ModelDims, vocab: int, rng: np.random.Generator, logit_std: float) -> dict[str, np.ndarray]:
    d, layers = dims.d_model, dims.layers

    def normal(shape, std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    out_scale = 1.0 / np.sqrt(2.0 * layers)  # keep the residual stream from growing with depth
    w: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes(dims, vocab).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("attn_norm", "mlp_norm"):
            w[name] = np.ones(shape, np.float32)
        elif name == "embed":
            w[name] = normal(shape, 1.0)
        elif name == "final_norm":
            # Tied head: logits = norm(x) . embed rows (std 1) -> scale the norm to get logit_std.
            scale = logit_std / np.sqrt(d) if dims.tie_embeddings else 1.0
            w[name] = np.full(shape, scale, np.float32)
        elif name == "lm_head":
            w[name] = normal(shape, logit_std / np.sqrt(d))
        elif leaf in ("wo", "w_down"):
            w[name] = normal(shape, out_scale / np.sqrt(shape[0]))
        else:
            w[name] = normal(shape, 1.0 / np.sqrt(shape[0]))
    return w


def _greedy(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens by full recompute, and the smallest top-1/top-2 logit gap seen."""
    seq, out, gap = list(prompt), [], np.inf
    for _ in range(n):
        last = model.dense_logits(seq)[-1]
        top2 = np.partition(last, -2)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        tok = int(np.argmax(last))
        out.append(tok)
        seq.append(tok)
    return out, gap


def _golden_cases(model: Transformer, rng: np.random.Generator, count: int, max_tokens: int,
                  bos: int, vocab: int, max_seq: int) -> list[dict]:
    cases = []
    text_vocab = min(vocab, 256) if vocab >= 259 else bos
    for i in range(count):
        length = min(_PROMPT_LENGTHS[i % len(_PROMPT_LENGTHS)], max_seq - max_tokens)
        if length < 1:
            raise ValueError("max_seq too small for the golden cases")
        for _attempt in range(50):
            # A one-token prompt is a random byte, so a near-tie can be redrawn.
            body = rng.integers(0, text_vocab, size=max(length - 1, 1)).tolist()
            prompt = body if length == 1 else [bos] + body
            tokens, gap = _greedy(model, prompt, max_tokens)
            if gap >= GOLDEN_MIN_GAP:
                break
        else:
            raise ValueError("could not find golden prompts without near-ties; try another seed")
        cases.append({"name": f"case{i}", "prompt": prompt, "max_tokens": max_tokens, "tokens": tokens,
                      "temperature": 0.0, "ignore_eos": True})
    return cases


def make_model(
    out_dir: str,
    *,
    name: str = "random",
    layers: int = 2,
    d_model: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    ffn_dim: int | None = None,
    vocab: int = 320,
    max_seq: int = 2048,
    seed: int = 0,
    block_size: int = 16,
    profiles: Sequence[int] = (1, 4, 8, 16),
    kv_num_blocks: int = 1024,
    golden_cases: int = 4,
    golden_max_tokens: int = 8,
    tie_embeddings: bool = False,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-5,
    logit_std: float = 3.0,
) -> str:
    """Write a package to `out_dir` (which must not exist or be empty); returns its absolute path.

    The package is assembled in a temp dir beside `out_dir` and renamed into
    place, so `out_dir` either holds a complete package or nothing.
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory")
    if head_dim is None:
        if d_model % heads:
            raise ValueError("d_model must be a multiple of heads (or pass head_dim)")
        head_dim = d_model // heads
    if ffn_dim is None:
        ffn_dim = max(16, int(round(d_model * 8 / 3 / 16)) * 16)
    dims = ModelDims(layers=layers, d_model=d_model, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     ffn_dim=ffn_dim, rope_theta=float(rope_theta), norm_eps=float(norm_eps),
                     tie_embeddings=bool(tie_embeddings))
    profiles = sorted({int(p) for p in profiles})
    if not profiles or profiles[0] < 1:
        raise ValueError("profiles must be positive batch sizes")
    if max_seq < 2 or block_size < 1 or kv_num_blocks < 1:
        raise ValueError("max_seq, block_size and kv_num_blocks must be positive")
    bos, eos_ids, pad = _special_ids(vocab)

    rng = np.random.default_rng(seed)
    weights = _random_weights(dims, vocab, rng, logit_std)
    model = Transformer(dims, weights, vocab_size=vocab, max_seq=max_seq)
    cases = _golden_cases(model, rng, golden_cases, golden_max_tokens, bos, vocab, max_seq)

    with package_folder(out_dir, ".make-model-") as tmp:
        np.savez(os.path.join(tmp, WEIGHTS), **weights)
        with open(os.path.join(tmp, GOLDEN), "w") as f:
            json.dump(cases, f, indent=1)
        manifest = {
            "schema": SCHEMA,
            "architecture": ARCHITECTURE,
            "name": name,
            "dims": dims.to_dict(),
            "vocab_size": vocab,
            "bos_id": bos,
            "eos_ids": eos_ids,
            "pad_id": pad,
            "tokenizer": {"kind": "bytes" if vocab >= 259 else "none"},
            "max_seq": max_seq,
            "block_size": block_size,
            "kv_num_blocks": kv_num_blocks,
            "profiles": [{"batch": p, "inactive_lane_policy": "mask"} for p in profiles],
            "seed": seed,
        }
        write_manifest(tmp, manifest, (WEIGHTS, GOLDEN))
    return out_dir
