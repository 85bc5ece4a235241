"""`npuserve make-lora`: write a random test LoRA adapter for a base model package (`workers.lora.maker`)."""

from __future__ import annotations

import argparse
import sys

from workers.lora.adapter_package import TARGETS
from workers.lora.maker import DEFAULT_TARGETS, make_lora
from workers.package_manifest import PackageError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve make-lora", description="Write a random-weight LoRA adapter.")
    ap.add_argument("--base", required=True, help="the base model package the adapter is for")
    ap.add_argument("--out", required=True, help="adapter directory to create (must not exist or be empty)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, help="scale numerator (the update is alpha/rank * A @ B); default 2*rank")
    ap.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), choices=TARGETS, metavar="MATRIX",
                    help=f"matrices to adapt, among {' '.join(TARGETS)} (default: {' '.join(DEFAULT_TARGETS)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", help="the adapter's name in its manifest (default: the folder name)")
    args = ap.parse_args(argv)
    try:
        path = make_lora(args.base, args.out, rank=args.rank, targets=args.targets, seed=args.seed,
                         alpha=args.alpha, name=args.name)
    except (ValueError, OSError, PackageError) as e:
        print(f"npuserve make-lora: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
