"""`npuserve bench micro backend`: a chip backend's throughput in-process and through a worker.

Both modes run the very same job sequence through the same job code
(`workers.execute_job.execute_job`: backend call + sampling); the worker mode adds
exactly what a daemon pays per job: the job record into the ring, the
doorbell, the worker's loop, the result record back and the result
doorbell (polled beside the link's socket, as the daemon does), with one job
in flight. The ratio worker/in-process is the worker overhead.
Both modes run with the worker's BLAS thread count (see
`workers.control.worker_environ`), so the ratio compares like with like.

`--tp` (tools/bench/micro/tp.py) and `--loop-steps` (tools/bench/micro/decode_loop.py:
the device-side multi-step decode against the worker's host loop) run their
own comparisons instead; the job stream is tools/bench/micro/jobs.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import shutil
import sys
import tempfile
from dataclasses import dataclass

from ipc.records import Job, JobStatus
from tools.bench.micro.jobs import JobFactory, WorkerRunner, Workload, round_seconds
from tools.bench.options import add
from tools.load.report import publish

BATCHES = (1, 4, 8, 16)
TARGET_RATIO = 0.80
_OPENBLAS_SET = ("openblas_set_num_threads", "openblas_set_num_threads64_", "scipy_openblas_set_num_threads64_",
                 "scipy_openblas_set_num_threads")


@dataclass(frozen=True)
class Row:
    mode: str  # "in-process" | "worker"
    phase: str  # "prefill" | "decode"
    batch: int
    tokens_per_s: float

    def to_dict(self) -> dict:
        return {"mode": self.mode, "phase": self.phase, "batch": self.batch, "tokens_per_s": self.tokens_per_s}


def openblas_threads(env) -> int | None:
    """How many threads OpenBLAS starts with in a process with this environment (None: it decides)."""
    for var in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        value = env.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def set_openblas_threads(n: int) -> int | None:
    """Resize the OpenBLAS pool of this process (numpy already loaded it); the new size, or None when not found.

    Why: the worker gets its BLAS threads from its launch environment
    (`workers.control.worker_environ`), which this process read too late, and
    the in-process row must run with the same pool for the ratio to be fair.
    """
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {parts[5].strip() for line in maps if len(parts := line.split(maxsplit=5)) == 6}
    except OSError:
        return None
    for path in sorted(p for p in paths if "openblas" in os.path.basename(p).lower()):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _OPENBLAS_SET:
            setter = getattr(lib, name, None)
            getter = getattr(lib, name.replace("_set_", "_get_"), None)
            if setter is not None and getter is not None:
                setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
                setter(n)
                return int(getter())
    return None


def run_rows(modes: dict[str, object], factories: dict[str, JobFactory], batch: int, workload: Workload) -> list[Row]:
    """Rows of every mode for one batch size.

    The modes take turns round by round, so that load from other processes
    (this is usually a shared machine) hits them alike; each row reports the
    median round, which ignores the odd round a neighbour stole.
    """
    rows = []
    for phase in ("prefill", "decode"):
        times: dict[str, list[float]] = {m: [] for m in modes}
        rounds: dict[str, list[Job]] = {}
        for mode, run_one in modes.items():
            f = factories[mode]
            if phase == "prefill":
                rounds[mode] = [f.prefill()]
            else:
                run_one(f.prefill())  # the decode rounds continue this context
                rounds[mode] = f.decodes()
            run_one(rounds[mode][0])  # warm-up
        tokens = batch * (workload.prompt_len if phase == "prefill" else len(next(iter(rounds.values()))))
        spent = 0.0
        while spent < workload.min_seconds * len(modes) or len(times[next(iter(modes))]) < 3:
            for mode, run_one in modes.items():
                t = round_seconds(run_one, rounds[mode])
                times[mode].append(t)
                spent += t
        for mode in modes:
            rows.append(Row(mode, phase, batch, tokens / statistics.median(times[mode])))
    return rows


def in_process_runner(backend):
    from workers.execute_job import execute_job

    def run_one(job: Job) -> None:
        out = execute_job(backend, job)
        assert out.status == JobStatus.OK, out.error

    return run_one


def ratios(rows: list[Row]) -> dict[tuple[str, int], float]:
    ip = {(r.phase, r.batch): r.tokens_per_s for r in rows if r.mode == "in-process"}
    return {(r.phase, r.batch): r.tokens_per_s / ip[(r.phase, r.batch)]
            for r in rows if r.mode == "worker" and (r.phase, r.batch) in ip}


def format_table(rows: list[Row]) -> str:
    rat = ratios(rows)
    by = {(r.mode, r.phase, r.batch): r.tokens_per_s for r in rows}
    lines = ["| phase | B | in-process tok/s | worker tok/s | worker / in-process |", "| --- | ---: | ---: | ---: | ---: |"]
    for phase in ("prefill", "decode"):
        for b in sorted({r.batch for r in rows}):
            ip, wk = by.get(("in-process", phase, b)), by.get(("worker", phase, b))
            r = rat.get((phase, b))
            lines.append(f"| {phase} | {b} | {ip:,.0f} | {wk:,.0f} | {r:.0%} |" if r is not None else
                         f"| {phase} | {b} | {ip or 0:,.0f} | {wk or 0:,.0f} | - |")
    return "\n".join(lines)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench micro backend", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="ref", help="stub | sim | ref | ctypes (default ref)")
    add(p, "package", helps={"package": "model package dir (ref; default: the tiny default package)"})
    p.add_argument("--library", default=None,
                   help="vendor shared library (ctypes; default: the reference C library, compiled into a temp dir)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64, help="prefill tokens per lane")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps per round")
    p.add_argument("--seconds", type=float, default=0.6, help="minimum measuring time per row")
    add(p, "json")
    p.add_argument("--tp", default=None,
                   help="comma-separated tensor-parallel degrees (ref only), e.g. 1,2: decode tokens/s per degree, "
                        "one process per rank, and the all-reduce vs a memcpy (tools/bench/micro/tp.py)")
    p.add_argument("--tp-rounds", type=int, default=3, help="--tp: decode rounds per run")
    p.add_argument("--tp-repeats", type=int, default=3, help="--tp: runs per degree, alternating")
    p.add_argument("--loop-steps", type=int, default=0,
                   help="ctypes only: decode in jobs of this many steps, the library's device loop against the "
                        "worker's host loop and one-step jobs (tools/bench/micro/decode_loop.py)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from workers.backends.registry import make_backend
    from workers.control import worker_environ

    worker_blas = openblas_threads(worker_environ())
    in_process_blas = set_openblas_threads(worker_blas) if worker_blas is not None else None
    if in_process_blas != worker_blas:
        print(f"bench-backend: warning: in-process BLAS threads {in_process_blas} differ from the worker's "
              f"{worker_blas}; the ratio compares unlike setups", file=sys.stderr)

    batches = tuple(int(x) for x in args.batches.split(","))
    package = args.package
    if args.backend == "ref" and package is None:
        from workers.default_package import ensure_default_package

        package = ensure_default_package()
    if args.tp is not None:
        if args.backend != "ref":
            print("bench-backend: --tp needs --backend ref", file=sys.stderr)
            return 2
        from tools.bench.micro.tp import run as run_tp

        return run_tp(args, package, list(batches))
    options: dict = {}
    scratch = None
    if args.loop_steps and (args.backend != "ctypes" or args.loop_steps < 2):
        print("bench-backend: --loop-steps needs --backend ctypes and at least 2 steps", file=sys.stderr)
        return 2
    if args.backend == "ctypes":
        library = args.library
        if library is None:
            from workers.backends.ctypes_backend import build_reference_library

            scratch = tempfile.mkdtemp(prefix="npuserve-bench-")
            library = str(build_reference_library(scratch))
        options["library"] = library
    try:
        if args.loop_steps:
            from tools.bench.micro.decode_loop import run as run_loop

            return run_loop(args, options, batches)
        return _run(args, make_backend(args.backend, **options), options, package, batches, worker_blas)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(args, backend, options: dict, package: str | None, batches: tuple[int, ...], worker_blas) -> int:
    loaded = None
    if package is not None:
        from workers.package_loader import load_package

        loaded = load_package(package)
    backend.load(loaded)
    info = backend.describe()
    bad = [b for b in batches if b not in {p.batch for p in info.profiles}]
    if bad:
        print(f"bench-backend: batch sizes {bad} are not profiles of this model", file=sys.stderr)
        return 2
    workload = Workload(prompt_len=args.prompt_len, decode_steps=args.decode_steps, min_seconds=args.seconds)
    worker = WorkerRunner(args.backend, options, package)
    rows: list[Row] = []
    try:
        worker.start()
        modes = {"in-process": in_process_runner(backend), "worker": worker}
        for b in batches:
            factories = {m: JobFactory(info, b, workload) for m in modes}
            rows += run_rows(modes, factories, b, workload)
    finally:
        worker.close()
        backend.unload()
    rows.sort(key=lambda r: (r.mode != "in-process", r.phase != "prefill", r.batch))
    lines = [("row", r.to_dict()) for r in rows]
    text = [f"backend {args.backend}, prompt {args.prompt_len} tokens/lane, {args.decode_steps} decode steps/round, "
            f"BLAS threads {worker_blas or 'default'} in both modes, one job in flight", format_table(rows)]
    rat = ratios(rows)
    if args.backend == "ref" and ("decode", 16) in rat:  # the target is about the ref model's compute
        r = rat[("decode", 16)]
        lines.append(("summary", {"decode_b16_worker_vs_in_process": round(r, 4), "target": TARGET_RATIO,
                                  "ok": r >= TARGET_RATIO}))
        text.append(f"worker/in-process decode tokens/s at B=16: {r:.1%} (target >= {TARGET_RATIO:.0%}: "
                    f"{'ok' if r >= TARGET_RATIO else 'BELOW TARGET'})")
    publish("bench-backend", args.json, lines, lambda: "\n".join(text))
    return 0
