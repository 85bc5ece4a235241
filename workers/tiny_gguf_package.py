"""The random-weight (tiny) model as a GGUF package, for the `llamacpp` backend.

`make_gguf_model` makes the `.npz` package with `workers.model_maker` (the
same parameters give the same weights and the same golden cases, computed
by the `ref` oracle) and rewrites its weights as a Llama GGUF, so
`check-package` on the result replays the oracle's golden tokens through
llama.cpp: the test that `ref` and `llamacpp` compute the same model.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from workers.gguf_package import FORMAT, GGUF_FILE, write_manifest
from workers.llama_gguf_writer import write_llama_gguf
from workers.model_maker import make_model
from workers.package_loader import load_package
from workers.package_manifest import GOLDEN, SCHEMA

# Bump when this maker changes what the same parameters produce (workers.default_package keys its cache by it).
GGUF_MAKER_VERSION = 2  # 2: the manifest records kv_shape


def make_gguf_model(out_dir: str, **params) -> str:
    """Write the tiny model (make-model parameters) as a GGUF package in `out_dir`; returns its path."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".make-gguf-", dir=parent)
    try:
        src = load_package(make_model(os.path.join(tmp, "npz"), **params))
        pkg = os.path.join(tmp, "pkg")
        os.mkdir(pkg)
        write_llama_gguf(os.path.join(pkg, GGUF_FILE), name=src.name, dims=src.dims, weights=src.weights(),
                         vocab_size=src.vocab_size, bos_id=src.bos_id, eos_id=src.eos_ids[0], pad_id=src.pad_id,
                         max_seq=src.max_seq)
        shutil.copyfile(src.file_path(GOLDEN), os.path.join(pkg, GOLDEN))
        m = src.manifest
        manifest = {
            "schema": SCHEMA, "format": FORMAT, "architecture": "llama", "name": m.get("name", "random"),
            "vocab_size": src.vocab_size, "bos_id": src.bos_id, "eos_ids": list(src.eos_ids), "pad_id": src.pad_id,
            "max_seq": src.max_seq, "context_length": src.max_seq, "block_size": src.block_size,
            "kv_num_blocks": src.kv_num_blocks, "profiles": m["profiles"],
            "tokenizer": {"kind": "bytes", "bos_id": src.bos_id, "eos_ids": list(src.eos_ids), "add_bos": True,
                          "chat_template": None},
            "source": {"made_by": "npuserve make-model --format gguf", "npz_manifest_sha256": src.sha256,
                       "dims": src.dims.to_dict(), "seed": m.get("seed")},
            "kv_shape": {"layers": src.dims.layers, "kv_heads": src.dims.kv_heads,
                         "key_length": src.dims.head_dim, "value_length": src.dims.head_dim},
        }
        write_manifest(pkg, manifest)
        os.chmod(pkg, 0o755)
        os.rename(pkg, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
