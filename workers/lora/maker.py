"""`npuserve make-lora`: a random test adapter for a base package, in the base package's adapter format
(an npz adapter for an `.npz` base, llama.cpp's LoRA GGUF for a GGUF base: `workers.lora.gguf_adapter`).

The low-rank factors are random (B is not zero, unlike a training init) and
sized so the adapter visibly changes the base model's greedy choices: the
update A @ B * alpha / rank has about `strength` times the spread of the base
matrix it adapts. Written beside `out` and renamed into place, like a model
package, so `out` holds a complete adapter or nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from workers.lora.adapter_package import ADAPTER_FILE, LORA_SCHEMA, TARGETS, tensor_names
from workers.model_package import ARCHITECTURE, ModelPackage
from workers.package_loader import load_package
from workers.package_manifest import package_folder, write_manifest
from workers.transformer import weight_shapes

DEFAULT_TARGETS = ("wq", "wv")


def make_lora(base: str, out_dir: str, *, rank: int = 8, targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0,
              alpha: float | None = None, name: str | None = None, strength: float = 0.5) -> str:
    """Write an adapter for the package at `base` to `out_dir` (absent or empty); returns its absolute path."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory")
    targets = list(dict.fromkeys(targets))
    bad = [t for t in targets if t not in TARGETS]
    if not targets or bad:
        raise ValueError(f"targets must be among {list(TARGETS)}, got {bad or 'none'}")
    if not 0 < rank <= 1024:
        raise ValueError("rank must be in 1..1024")
    alpha = float(2 * rank if alpha is None else alpha)
    if not alpha > 0:
        raise ValueError("alpha must be positive")
    pkg = load_package(base)
    if not isinstance(pkg, ModelPackage):  # a GGUF base: llama.cpp's LoRA GGUF
        from workers.lora.gguf_adapter import make_gguf_lora
        return make_gguf_lora(pkg, out_dir, rank=rank, targets=targets, seed=seed, alpha=alpha,
                              name=name or os.path.basename(out_dir), strength=strength)
    dims = pkg.dims
    shapes = weight_shapes(dims, pkg.vocab_size)
    rng = np.random.default_rng(seed)
    scale = alpha / rank
    tensors: dict[str, np.ndarray] = {}
    for i in range(dims.layers):
        for t in targets:
            n_in, n_out = shapes[f"layers.{i}.{t}"]
            a_name, b_name = tensor_names(i, t)
            tensors[a_name] = (rng.standard_normal((n_in, rank)) / np.sqrt(n_in)).astype(np.float32)
            b_std = strength / (scale * np.sqrt(rank))
            tensors[b_name] = (rng.standard_normal((rank, n_out)) * b_std).astype(np.float32)
    with package_folder(out_dir, ".make-lora-") as tmp:
        np.savez(os.path.join(tmp, ADAPTER_FILE), **tensors)
        manifest = {
            "schema": LORA_SCHEMA,
            "format": "npz",
            "name": name or os.path.basename(out_dir),
            "rank": rank,
            "alpha": alpha,
            "targets": targets,
            "base": {"architecture": ARCHITECTURE, "layers": dims.layers, "name": pkg.name, "sha256": pkg.sha256},
            "seed": seed,
        }
        write_manifest(tmp, manifest, (ADAPTER_FILE,))
    return out_dir
