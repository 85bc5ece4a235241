"""`npuserve fuzz` / `python -m tools.fuzz`: run each harness under atheris for a time (or run) budget.

Each harness runs in its own subprocess (`tools.fuzz.run_one`), since libFuzzer exits the process on
a finding; after a finding the harness is started again on the same corpus until its budget is spent,
and findings are told apart by their signature (exception type and innermost frame). Inputs that broke a
contract are saved under OUT/NAME/findings/ (crash-*, timeout-*, oom-*), the grown corpus under
OUT/NAME/corpus/. Progress goes to stderr; with --json, stdout has one line per harness (`kind: row`),
per finding (`kind: finding`) and a `kind: summary`. Exit status 1 when any harness found something.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.fuzz import HARNESSES
from tools.json_lines import emit

_EXECS = re.compile(r"^#(\d+)\s")
_FINAL = re.compile(r"^stat::number_of_executed_units:\s*(\d+)")
_ARTIFACT = re.compile(r"Test unit written to (\S+)")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
MAX_RESTARTS = 200  # a harness that finds something at once must not spin for its whole budget


@dataclass
class Finding:
    signature: str
    artifact: str | None
    detail: str


@dataclass
class HarnessResult:
    name: str
    executions: int = 0
    seconds: float = 0.0
    processes: int = 0
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _signature(lines: list[str]) -> tuple[str, str]:
    """(signature, detail) of one failed process: the exception line and its innermost frame, or the
    libFuzzer verdict (timeout, out-of-memory, deadly signal)."""
    text = "\n".join(lines)
    if "ERROR: libFuzzer: timeout" in text:
        return "timeout", "an input ran past -timeout"
    if "out-of-memory" in text:
        return "oom", "an input went past -rss_limit_mb"
    if "Uncaught Python exception" in text:
        start = max(i for i, ln in enumerate(lines) if "Uncaught Python exception" in ln)
        tb = lines[start + 1:]
        exc = tb[0].strip() if tb else "?"
        frames = [m.groups() for m in map(_FRAME.match, tb) if m]
        where = f"{Path(frames[-1][0]).name}:{frames[-1][1]} {frames[-1][2]}" if frames else "?"
        kind, _, msg = exc.partition(":")
        if " | " in msg:  # a harness's Finding: "what broke | the input" (the input is not in the signature)
            kind = f"{kind}:{msg.split(' | ', 1)[0]}"
        return f"{kind} at {where}", exc[:300]
    for ln in lines:
        if "deadly signal" in ln or "ERROR: libFuzzer" in ln:
            return ln.strip()[:120], ln.strip()[:300]
    return "exited", (lines[-1] if lines else "")[:300]


def _write_seeds(name: str, corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for seed in importlib.import_module(f"tools.fuzz.{name}").SEEDS:
        (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)


def run_harness(name: str, out: Path, seconds: float | None, runs: int | None, *, seed: int = 0,
                timeout_s: int = 20, rss_mb: int = 2048, preload: str | None = None, first: bool = False,
                progress=None) -> HarnessResult:
    res = HarnessResult(name)
    corpus, findings = out / name / "corpus", out / name / "findings"
    _write_seeds(name, corpus)
    findings.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    t0 = time.monotonic()
    while res.processes < MAX_RESTARTS:
        left_s = None if seconds is None else seconds - (time.monotonic() - t0)
        left_runs = None if runs is None else runs - res.executions
        if (left_s is not None and left_s < 1) or (left_runs is not None and left_runs <= 0):
            break
        cmd = [sys.executable, "-m", "tools.fuzz.run_one", name]
        if preload:
            cmd += ["--preload", preload]
        cmd += [f"-artifact_prefix={findings}/", f"-timeout={timeout_s}", f"-rss_limit_mb={rss_mb}",
                "-print_final_stats=1", f"-seed={seed + res.processes}" if seed else "-seed=0"]
        cmd += [f"-max_total_time={int(left_s)}"] if left_s is not None else []
        cmd += [f"-runs={left_runs}"] if left_runs is not None else []
        cmd.append(str(corpus))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        res.processes += 1
        lines: list[str] = []
        execs = final = 0
        artifact = None
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if len(lines) > 400:
                del lines[:200]
            if m := _EXECS.match(line):
                execs = int(m.group(1))
                if progress:
                    progress(name, res.executions + execs, time.monotonic() - t0, len(res.findings))
            elif m := _FINAL.match(line):
                final = int(m.group(1))
            elif m := _ARTIFACT.search(line):
                artifact = m.group(1)
        rc = proc.wait()
        res.executions += max(final, execs)
        if rc != 0:
            if artifact is None and "Uncaught Python exception" not in "\n".join(lines) \
                    and "libFuzzer" not in "\n".join(lines[-20:]):
                res.errors.append("\n".join(lines[-20:]))  # the harness did not start: not a finding
                break
            sig, detail = _signature(lines)
            if sig not in seen:
                seen.add(sig)
                res.findings.append(Finding(sig, artifact, detail))
                if progress:
                    progress(name, res.executions, time.monotonic() - t0, len(res.findings), res.findings[-1])
            elif artifact and artifact not in {f.artifact for f in res.findings}:
                Path(artifact).unlink(missing_ok=True)  # another input for a finding already saved
            if first:
                break
    res.seconds = time.monotonic() - t0
    return res


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("harness", nargs="*", choices=[[], *HARNESSES], metavar="HARNESS",
                   help=f"harnesses to run (default: all of {', '.join(HARNESSES)})")
    p.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_SECONDS", 300)),
                   help="time budget per harness (default: $FUZZ_SECONDS or 300)")
    p.add_argument("--runs", type=int, default=None,
                   help="a number of executions per harness instead of a time budget (speed-independent)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("FUZZ_OUT", ".fuzz-out")),
                   help="corpora and findings (default: $FUZZ_OUT or .fuzz-out)")
    p.add_argument("--seed", type=int, default=0, help="libFuzzer seed (0: a random one each process)")
    p.add_argument("--timeout", type=int, default=20, help="seconds one input may run before it is a hang")
    p.add_argument("--first", action="store_true", help="stop each harness at its first finding")
    p.add_argument("--preload", default=None, help=argparse.SUPPRESS)  # tests: a module that breaks a decoder
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    names = args.harness or list(HARNESSES)
    last = [0.0]

    def progress(name, execs, elapsed, n_findings, finding=None):
        if finding is not None:
            print(f"\n{name}: FINDING {finding.signature} -> {finding.artifact}", file=sys.stderr, flush=True)
        elif time.monotonic() - last[0] > 1.0:
            last[0] = time.monotonic()
            print(f"\r{name}: {execs} executions, {n_findings} findings, {elapsed:.0f} s", end="",
                  file=sys.stderr, flush=True)

    results = []
    for name in names:
        r = run_harness(name, args.out, None if args.runs else args.seconds, args.runs, seed=args.seed,
                        timeout_s=args.timeout, preload=args.preload, first=args.first,
                        progress=progress)
        results.append(r)
        print(f"\r{name}: {r.executions} executions, {len(r.findings)} findings, {r.seconds:.0f} s, "
              f"{r.processes} process(es)", file=sys.stderr, flush=True)
        for e in r.errors:
            print(f"{name}: the harness did not run:\n{e}", file=sys.stderr)
        if args.json:
            emit("row", {"harness": name, "executions": r.executions, "findings": len(r.findings),
                         "elapsed_s": round(r.seconds, 1), "processes": r.processes, "errors": r.errors})
            for f in r.findings:
                emit("finding", {"harness": name, "signature": f.signature, "artifact": f.artifact,
                                 "detail": f.detail})
        else:
            print(f"{name:14s} {r.executions:>10d} executions  {len(r.findings)} findings")
            for f in r.findings:
                print(f"  {f.signature}\n    {f.detail}\n    input: {f.artifact}")
    total = sum(len(r.findings) for r in results)
    broken = any(r.errors for r in results)
    if args.json:
        emit("summary", {"harnesses": len(results), "executions": sum(r.executions for r in results),
                         "findings": total, "errors": sum(len(r.errors) for r in results)})
    return 1 if total or broken else 0


if __name__ == "__main__":
    sys.exit(main())
