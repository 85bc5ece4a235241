"""`npuserve import-gguf FILE --out DIR [--name NAME]`: make a model package around a GGUF file.

The manifest pins the GGUF's sha256 and records, from the GGUF metadata as
llama.cpp reads it, the architecture, vocabulary size, context length,
BOS/EOS ids and chat template; greedy golden cases are run through llama.cpp
(one sequence alone) and stored, so `npuserve check-package DIR` can replay
them through the serving path. The GGUF is hard-linked into the package when
the file system allows, copied otherwise. Importing the same file into the
same folder again changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from tools.make_model_cmd import profile_list
from workers.gguf_package import FORMAT, GGUF_FILE, kv_shape_from_metadata, write_manifest
from workers.package_loader import load_package
from workers.package_manifest import GOLDEN, MANIFEST, SCHEMA, PackageError, file_sha256

GOLDEN_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
)
DEFAULT_PROFILES = (1, 2, 4, 8, 16, 32)


def _metadata(model, path: str) -> dict:
    info = model.info
    arch = model.meta("general.architecture") or "unknown"
    ctx_train = model.meta(f"{arch}.context_length")
    eos_ids = [info["eos"]]
    if info["eot"] >= 0 and info["eot"] not in eos_ids and model.is_eog(info["eot"]):
        eos_ids.append(info["eot"])
    pad = model.meta("tokenizer.ggml.padding_token_id")
    return {
        "architecture": arch,
        "name": model.meta("general.name") or os.path.splitext(os.path.basename(path))[0],
        "vocab_size": info["n_vocab"],
        "bos_id": info["bos"],
        "eos_ids": eos_ids,
        "pad_id": int(pad) if pad is not None and pad.isdigit() else info["eos"],
        "add_bos": bool(info["add_bos"]),
        "context_length": int(ctx_train) if ctx_train and ctx_train.isdigit() else 0,
        "chat_template": model.meta("tokenizer.chat_template"),
        "kv_shape": kv_shape_from_metadata(model.meta),
    }


def _place_gguf(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
        return "hard-linked"
    except OSError:
        shutil.copyfile(src, dst)
        return "copied"


def import_gguf(path: str, out_dir: str, *, name: str | None = None, max_seq: int = 4096, block_size: int = 16,
                kv_num_blocks: int = 512, profiles=DEFAULT_PROFILES, golden_max_tokens: int = 8,
                threads: int = 0, progress=print) -> tuple[str, bool]:
    """Import `path` into `out_dir`; returns (package path, whether anything was written)."""
    from workers.backends.llamacpp import default_threads
    from workers.llamacpp.binding import LlamaModel
    from workers.llamacpp.solo import greedy_solo

    path, out_dir = os.path.abspath(path), os.path.abspath(out_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    progress(f"hashing {path} ...")
    digest = file_sha256(path)
    if os.path.isfile(os.path.join(out_dir, MANIFEST)):
        pkg = load_package(out_dir)
        if pkg.manifest.get("files", {}).get(GGUF_FILE) == digest and (name is None or pkg.name == name):
            return out_dir, False
        raise FileExistsError(f"{out_dir}: holds another package (remove it or choose another --out)")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory")

    progress("reading the GGUF metadata and running the golden cases through llama.cpp ...")
    vocab = LlamaModel(path, vocab_only=True)
    try:
        meta = _metadata(vocab, path)
        prompts = [vocab.tokenize(p, add_special=True) for p in GOLDEN_PROMPTS]
    finally:
        vocab.close()
    if meta["context_length"]:
        max_seq = min(max_seq, meta["context_length"])
    model = LlamaModel(path, n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=1, n_threads=threads or default_threads())
    try:
        cases = []
        for i, prompt in enumerate(prompts):
            tokens, gaps = greedy_solo(model, prompt, golden_max_tokens)
            cases.append({"name": f"case{i}", "text": GOLDEN_PROMPTS[i], "prompt": prompt,
                          "max_tokens": golden_max_tokens, "tokens": tokens, "temperature": 0.0, "ignore_eos": True,
                          "min_top2_gap": round(min(gaps), 6)})
    finally:
        model.close()

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".import-gguf-", dir=parent)
    try:
        how = _place_gguf(path, os.path.join(tmp, GGUF_FILE))
        with open(os.path.join(tmp, GOLDEN), "w") as f:
            json.dump(cases, f, indent=1)
        manifest = {
            "schema": SCHEMA, "format": FORMAT, "architecture": meta["architecture"],
            "name": name or meta["name"], "vocab_size": meta["vocab_size"], "bos_id": meta["bos_id"],
            "eos_ids": meta["eos_ids"], "pad_id": meta["pad_id"], "max_seq": max_seq,
            "context_length": meta["context_length"], "block_size": block_size, "kv_num_blocks": kv_num_blocks,
            "profiles": [{"batch": int(b), "inactive_lane_policy": "mask"} for b in sorted(set(profiles))],
            "tokenizer": {"kind": "gguf", "file": GGUF_FILE, "bos_id": meta["bos_id"], "eos_ids": meta["eos_ids"],
                          "add_bos": meta["add_bos"], "chat_template": meta["chat_template"]},
            "source": {"file": os.path.basename(path), "imported_by": "npuserve import-gguf"},
        }
        if meta["kv_shape"]:
            manifest["kv_shape"] = meta["kv_shape"]
        write_manifest(tmp, manifest)
        if manifest["files"][GGUF_FILE] != digest:
            raise PackageError(f"{path}: changed while it was being imported")
        os.chmod(tmp, 0o755)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"GGUF {how} into the package")
    return out_dir, True


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve import-gguf", description=__doc__.splitlines()[0])
    ap.add_argument("file", help="the .gguf file")
    ap.add_argument("--out", required=True, help="package directory to create")
    ap.add_argument("--name", help="model name (default: the GGUF's general.name)")
    ap.add_argument("--max-seq", type=int, default=4096, help="longest sequence served (capped by the model's context)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=512, help="default KV pool per chip, in blocks")
    ap.add_argument("--profiles", type=profile_list, default=list(DEFAULT_PROFILES), help="batch sizes, e.g. 1,4,8,16,32")
    ap.add_argument("--golden-max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp threads for the golden run (0 = all cores)")
    args = ap.parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731 - progress on stderr, the path on stdout
    try:
        path, wrote = import_gguf(args.file, args.out, name=args.name, max_seq=args.max_seq,
                                  block_size=args.block_size, kv_num_blocks=args.kv_blocks, profiles=args.profiles,
                                  golden_max_tokens=args.golden_max_tokens, threads=args.threads, progress=say)
    except (OSError, PackageError, ValueError, RuntimeError) as e:
        print(f"npuserve import-gguf: {e}", file=sys.stderr)
        return 1
    if not wrote:
        say(f"{path}: already holds this GGUF; nothing to do")
    print(path)
    return 0
