"""`npuserve make-model`: write a random-weight model package with golden cases (`.npz`, or the same as GGUF).

The makers are `workers.model_maker` and `workers.tiny_gguf_package`; `--default`
starts from the built-in tiny model's parameters (`workers.default_package`).
"""

from __future__ import annotations

import argparse
import sys

from workers.default_package import default_model_params
from workers.model_maker import make_model
from workers.package_manifest import PackageError
from workers.tiny_gguf_package import make_gguf_model


def profile_list(text: str) -> list[int]:
    """`--profiles 1,4,8` -> [1, 4, 8] (an argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad profile list {text!r}") from e


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve make-model", description="Write a random-weight model package.")
    ap.add_argument("--out", required=True, help="package directory to create (must not exist or be empty)")
    ap.add_argument("--default", action="store_true", help="start from the built-in tiny model's parameters")
    ap.add_argument("--name")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ffn-dim", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--max-seq", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--profiles", type=profile_list, help="comma-separated compiled batch sizes, e.g. 1,4,8,16")
    ap.add_argument("--kv-blocks", type=int, dest="kv_num_blocks", help="default KV pool size in blocks")
    ap.add_argument("--golden-cases", type=int)
    ap.add_argument("--golden-max-tokens", type=int)
    ap.add_argument("--tied", action="store_true", default=None, dest="tie_embeddings", help="tie the LM head to the embedding")
    ap.add_argument("--format", choices=("npz", "gguf"), default="npz",
                    help="npz: weights.npz for the ref backend; gguf: the same weights as a Llama GGUF (llamacpp)")
    args = vars(ap.parse_args(argv))
    out, use_default, fmt = args.pop("out"), args.pop("default"), args.pop("format")
    params: dict = {}
    if use_default:
        params.update(default_model_params())
    params.update({k: v for k, v in args.items() if v is not None})
    maker = make_gguf_model if fmt == "gguf" else make_model
    try:
        path = maker(out, **params)
    except (ValueError, OSError, PackageError) as e:
        print(f"npuserve make-model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
