"""llama.cpp's LoRA GGUF as an npuserve adapter package (`llamacpp` backend): write, check against a base, convert.

The package is the npz one's manifest with `"format": "gguf"` and one file,
`adapter.gguf`: llama.cpp's adapter format (`general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, and per adapted tensor
`<tensor>.lora_a` (ggml shape [in, rank]) and `<tensor>.lora_b` ([rank, out])),
which `llama_adapter_lora_init` loads. llama.cpp computes
`W x + alpha / rank * B (A x)`, as the npz adapter does.

`check_gguf_against_base` compares the adapter's architecture, block count
and every tensor's shape with the base GGUF's, from the two files' headers
(`workers.lora.gguf_header`; no tensor data is read).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np

from workers.lora.adapter_package import LORA_SCHEMA, TARGETS, AdapterFacts
from workers.package_manifest import PackageError, package_folder, write_manifest

GGUF_ADAPTER_FILE = "adapter.gguf"
# the npz adapter's target names -> llama.cpp's tensor names (blk.{i}.NAME.weight)
GGUF_TENSOR = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
               "w_up": "ffn_up", "w_down": "ffn_down"}


def gguf_header(path: str) -> tuple[str, int, dict[str, tuple[int, ...]], dict[str, object]]:
    """(architecture, block count, {tensor name: ggml shape}, scalar metadata) of a GGUF, from its header.

    Cached per file version (path, size, mtime): a base model's header is read for every adapter load and
    swap, and a large vocabulary makes it take a second or two."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise PackageError(f"{path}: cannot read ({e.strerror})") from e
    return _header(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _header(path: str, _size: int, _mtime_ns: int):
    from workers.lora.gguf_header import read_gguf_header

    try:
        meta, shapes = read_gguf_header(path)
    except (OSError, ValueError) as e:
        raise PackageError(f"{path}: not a readable GGUF ({e})") from e
    arch = str(meta.get("general.architecture") or "")
    return arch, int(meta.get(f"{arch}.block_count") or 0), shapes, meta


def check_gguf_against_base(facts: AdapterFacts, base_gguf: str) -> None:
    """PackageError unless the LoRA GGUF fits the base GGUF: architecture, blocks, every tensor's shape."""
    apath = os.path.join(facts.path, GGUF_ADAPTER_FILE)
    a_arch, _, a_shapes, a_meta = gguf_header(apath)
    arch, blocks, shapes, _ = gguf_header(base_gguf)
    if a_meta.get("general.type") != "adapter" or a_meta.get("adapter.type") != "lora":
        raise PackageError(f"{apath}: not a LoRA adapter GGUF (general.type / adapter.type)")
    if a_arch != arch or facts.base_architecture != arch:
        raise PackageError(f"{apath}: made for architecture {a_arch!r}, the base model is {arch!r}")
    if facts.base_layers != blocks:
        raise PackageError(f"{apath}: made for {facts.base_layers} layers, the base model has {blocks}")
    names = {n[:-len(".lora_a")] for n in a_shapes if n.endswith(".lora_a")}
    if not names or len(a_shapes) != 2 * len(names):
        raise PackageError(f"{apath}: tensors must come in .lora_a / .lora_b pairs")
    for n in sorted(names):
        w, a, b = shapes.get(n), a_shapes.get(n + ".lora_a"), a_shapes.get(n + ".lora_b")
        if w is None:
            raise PackageError(f"{apath}: adapts {n!r}, which the base model does not have")
        if b is None or len(w) != 2 or a[0] != w[0] or b[1] != w[1] or a[1] != b[0] or a[1] != facts.rank:
            raise PackageError(f"{apath}: {n} has lora_a {a} / lora_b {b}; the base model's {w} needs "
                               f"[{w[0]}, {facts.rank}] / [{facts.rank}, {w[1] if len(w) > 1 else '?'}]")


def write_gguf_adapter(out_dir: str, *, arch: str, layers: int, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
                       rank: int, alpha: float, targets: Sequence[str], name: str, base_name: str,
                       base_sha256: str, seed: int | None = None) -> str:
    """Write an adapter package: `pairs` maps a base tensor name to (A [rank, in], B [out, rank]) numpy arrays."""
    import gguf

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory")
    with package_folder(out_dir, ".make-lora-") as tmp:
        w = gguf.GGUFWriter(os.path.join(tmp, GGUF_ADAPTER_FILE), arch)
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(alpha))
        w.add_name(name)
        for tname, (a, b) in sorted(pairs.items()):
            w.add_tensor(tname + ".lora_a", np.ascontiguousarray(a, dtype=np.float32))
            w.add_tensor(tname + ".lora_b", np.ascontiguousarray(b, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        manifest = {"schema": LORA_SCHEMA, "format": "gguf", "name": name, "rank": rank, "alpha": float(alpha),
                    "targets": list(targets),
                    "base": {"architecture": arch, "layers": layers, "name": base_name, "sha256": base_sha256}}
        if seed is not None:
            manifest["seed"] = seed
        write_manifest(tmp, manifest, (GGUF_ADAPTER_FILE,))
    return out_dir


def make_gguf_lora(pkg, out_dir: str, *, rank: int, targets: Sequence[str], seed: int, alpha: float,
                   name: str, strength: float) -> str:
    """A random adapter for a GGUF base package (`workers.gguf_package.GgufPackage`), shapes from its header."""
    arch, blocks, shapes, _ = gguf_header(pkg.gguf_path)
    rng = np.random.default_rng(seed)
    scale = alpha / rank
    pairs = {}
    for i in range(blocks):
        for t in targets:
            tname = f"blk.{i}.{GGUF_TENSOR[t]}.weight"
            if tname not in shapes or len(shapes[tname]) != 2:
                raise PackageError(f"{pkg.gguf_path}: no 2-D tensor {tname} to adapt")
            n_in, n_out = shapes[tname]
            a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * (strength / (scale * np.sqrt(rank)))).astype(np.float32)
            pairs[tname] = (a, b)
    return write_gguf_adapter(out_dir, arch=arch, layers=blocks, pairs=pairs, rank=rank, alpha=alpha,
                              targets=targets, name=name, base_name=pkg.name, base_sha256=pkg.sha256, seed=seed)


def npz_adapter_to_gguf(npz_adapter: str, base_pkg, out_dir: str) -> str:
    """The same adapter as a LoRA GGUF for the GGUF form of its base (`make-model --format gguf`): the tensors
    transposed to llama.cpp's layout and Q/K rows permuted as the model writer permutes them."""
    from workers.llama_gguf_writer import _permute_rope
    from workers.lora.adapter_package import read_adapter, read_adapter_facts
    from workers.transformer import ModelDims

    facts = read_adapter_facts(npz_adapter)
    dims = ModelDims.from_dict(base_pkg.manifest["source"]["dims"])
    w = read_adapter(facts)  # B carries alpha/rank: write it back without, llama.cpp applies alpha/rank itself
    pairs = {}
    for (i, t), (a, b) in w.pairs.items():
        bl = (b / np.float32(facts.scale)).T  # [out, rank]
        if t in ("wq", "wk"):
            bl = _permute_rope(bl, dims.heads if t == "wq" else dims.kv_heads)
        pairs[f"blk.{i}.{GGUF_TENSOR[t]}.weight"] = (a.T, bl)
    return write_gguf_adapter(out_dir, arch="llama", layers=dims.layers, pairs=pairs, rank=facts.rank,
                              alpha=facts.alpha, targets=facts.targets, name=facts.name, base_name=base_pkg.name,
                              base_sha256=base_pkg.sha256)


assert set(GGUF_TENSOR) == set(TARGETS)
