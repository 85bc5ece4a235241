"""`npuserve check-package DIR [--json]`: verify a model package and run its golden cases.

The golden tokens were produced by the cache-free full recompute; here they
are replayed through the serving path (paged prefill, then one decode job per
token on the `ref` backend, greedy), so a pass means the package is intact
and the paged implementation agrees with the oracle on it. A GGUF package
replays them through llama.cpp (the `llamacpp` backend) instead. The verdicts are
`engine.core.golden_check`'s, as for `npuserve golden` and the daemon's load.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np

from engine.core.golden_check import Outcome, Status, check_cases, expected_outcome
from ipc.records import JobKind
from workers.backends.base import BackendError
from workers.backends.ref import RefBackend
from ipc.records import Lane, build_job
from workers.model_package import ModelPackage
from workers.package_loader import load_package
from workers.package_manifest import PackageError
from workers.sampling import sample


@dataclass
class CheckReport:
    ok: bool
    cases: int
    passed: int
    error: str | None

    def to_dict(self) -> dict:
        return {"ok": self.ok, "cases": self.cases, "passed": self.passed, "error": self.error}


def greedy_generate(backend: RefBackend, prompt: list[int], max_tokens: int, block_size: int) -> list[int]:
    """Greedy tokens for one sequence on blocks 0..n-1 of the backend's KV pool (EOS ignored)."""
    n_blocks = -(-(len(prompt) + max_tokens) // block_size)
    table = list(range(n_blocks))
    greedy = (np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32), np.zeros(1, np.uint64))

    def pick(logits: np.ndarray, pos: int) -> int:
        return int(sample(logits[:1], *greedy, np.array([pos]))[0][0])

    out = backend.prefill(build_job(JobKind.PREFILL, [Lane(prompt, 0, table)]))
    tokens = [pick(out.logits, len(prompt))]
    while len(tokens) < max_tokens:
        pos = len(prompt) + len(tokens) - 1
        out = backend.decode(build_job(JobKind.DECODE, [Lane([tokens[-1]], pos, table)]))
        tokens.append(pick(out.logits, pos + 1))
    return tokens


def _backend_for(package):
    """`ref` for an .npz package, `llamacpp` (one thread per core) for a GGUF package."""
    if getattr(package, "gguf_path", None):
        from workers.backends.llamacpp import LlamacppBackend

        return LlamacppBackend()
    return RefBackend()


def check_package(path: str) -> CheckReport:
    try:
        package: ModelPackage = load_package(path)
    except PackageError as e:
        return CheckReport(False, 0, 0, str(e))
    cases = package.golden()
    backend = _backend_for(package)
    try:
        backend.load(package)
        outcomes = []
        for case in cases:
            got = greedy_generate(backend, case["prompt"], case["max_tokens"], package.block_size)
            # what a server returns for these tokens: cut before EOS unless the case ignores it
            outcomes.append(Outcome(*expected_outcome({**case, "tokens": got}, package.eos_ids)))
    except (PackageError, BackendError, ValueError) as e:
        return CheckReport(False, len(cases), 0, str(e))
    finally:
        backend.unload()
    if not cases:
        return CheckReport(False, 0, 0, f"{package.file_path('golden.json')}: no golden cases")
    report = check_cases(cases, outcomes, package.eos_ids)
    failures = [f"case {v.name}: {v.reason}" for v in report.verdicts if not v.ok]
    return CheckReport(report.ok, len(cases), report.count(Status.PASS), "; ".join(failures) or None)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve check-package", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="model package directory")
    ap.add_argument("--json", action="store_true", help='print {"ok", "cases", "passed", "error"}')
    args = ap.parse_args(argv)
    report = check_package(args.dir)
    if args.json:
        print(json.dumps(report.to_dict()))
    elif report.ok:
        print(f"ok: {report.passed}/{report.cases} golden cases passed ({args.dir})")
    else:
        print(f"FAILED: {report.passed}/{report.cases} golden cases passed: {report.error}", file=sys.stderr)
    return 0 if report.ok else 1
