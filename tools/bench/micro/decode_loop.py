"""`npuserve bench micro decode-loop` (= `bench micro backend --backend ctypes --loop-steps N`): the
autoregressive loop on the device against per-step host round trips: what running the whole loop on
the device saves (docs/benchmarks.md).

The same decode work (B lanes, `--decode-steps` tokens per lane per round after a `--prompt-len` prefill)
three ways, on one chip library:

* `per-step`: one-step decode jobs (`executor.decode_steps = 1`): per token a job, a library call, sampling
  on the host, and (through a worker) a ring round trip;
* `host-loop`: N-step jobs that the worker loops itself (the library's one-step decode, then sampling in
  Python, N times per job): one round trip per N tokens;
* `device-loop`: N-step jobs run by `simpler_model_decode_steps_paged`: one library call per N tokens,
  sampled inside the library.

Each way runs in-process (`workers.execute_job.execute_job`) and through a worker process (ring, doorbells, one job
in flight). Every (mode, way) takes its turn round by round, so load from other processes hits them alike;
a row is the median round. In-process the three ways share one backend (`device_loop` switched per way) on
disjoint KV blocks; through workers, the host ways run on a worker with `device_loop=False`.
"""

from __future__ import annotations

import statistics

from ipc.records import JobStatus
from tools.bench.micro.jobs import JobFactory, WorkerRunner, Workload, round_seconds
from tools.load.report import publish

WAYS = ("per-step", "host-loop", "device-loop")
MODES = ("in-process", "worker")


def _in_process(backend, device_loop: bool):
    from workers.execute_job import execute_job

    def run_one(job) -> None:
        backend.device_loop = device_loop
        out = execute_job(backend, job)
        assert out.status == JobStatus.OK, out.error

    return run_one


def measure(runners: dict, factories: dict, steps: int, workload: Workload, batch: int) -> list[dict]:
    """tokens/s of each (mode, way) at one batch size: the median of alternating rounds."""
    rounds = {}
    for key, run_one in runners.items():
        f = factories[key]
        run_one(f.prefill())
        rounds[key] = f.decodes(1 if key[1] == "per-step" else steps)
        run_one(rounds[key][0])  # warm-up (rewrites the first positions: the round starts there again)
    times: dict = {key: [] for key in runners}
    spent = 0.0
    while spent < workload.min_seconds * len(runners) or min(len(t) for t in times.values()) < 3:
        for key, run_one in runners.items():
            t = round_seconds(run_one, rounds[key])
            times[key].append(t)
            spent += t
    tokens = batch * workload.decode_steps
    rows = []
    for (mode, way), ts in times.items():
        rows.append({"loop": way, "mode": mode, "batch": batch, "steps_per_job": 1 if way == "per-step" else steps,
                     "jobs_per_round": len(rounds[(mode, way)]), "tokens_per_s": tokens / statistics.median(ts)})
    return rows


def compare(rows: list[dict]) -> list[dict]:
    """Per (mode, batch): the device loop against the host loop and against one-step jobs."""
    by = {(r["mode"], r["batch"], r["loop"]): r["tokens_per_s"] for r in rows}
    out = []
    for mode, b in sorted({(r["mode"], r["batch"]) for r in rows}, key=lambda x: (MODES.index(x[0]), x[1])):
        dev = by[(mode, b, "device-loop")]
        out.append({"mode": mode, "batch": b, "device_vs_host_loop": dev / by[(mode, b, "host-loop")],
                    "device_vs_per_step": dev / by[(mode, b, "per-step")],
                    "host_loop_vs_per_step": by[(mode, b, "host-loop")] / by[(mode, b, "per-step")]})
    return out


def format_table(rows: list[dict], steps: int) -> str:
    by = {(r["mode"], r["batch"], r["loop"]): r["tokens_per_s"] for r in rows}
    lines = [f"| mode | B | per-step tok/s | host loop ({steps}/job) tok/s | device loop ({steps}/job) tok/s "
             "| device / host loop | device / per-step |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in compare(rows):
        m, b = c["mode"], c["batch"]
        lines.append(f"| {m} | {b} | {by[(m, b, 'per-step')]:,.0f} | {by[(m, b, 'host-loop')]:,.0f} "
                     f"| {by[(m, b, 'device-loop')]:,.0f} | {c['device_vs_host_loop']:.2f}x "
                     f"| {c['device_vs_per_step']:.2f}x |")
    return "\n".join(lines)


def run(args, options: dict, batches: tuple[int, ...]) -> int:
    from workers.backends.registry import make_backend

    steps = args.loop_steps
    backend = make_backend("ctypes", **options)
    if not backend.device_loop:
        raise SystemExit(f"bench-backend: {options['library']} has no device loop (simpler_model_decode_steps_paged)")
    backend.load(None)
    info = backend.describe()
    bad = [b for b in batches if b not in {p.batch for p in info.profiles}]
    if bad:
        raise SystemExit(f"bench-backend: batch sizes {bad} are not profiles of this library")
    workload = Workload(prompt_len=args.prompt_len, decode_steps=args.decode_steps, min_seconds=args.seconds)
    host = WorkerRunner("ctypes", dict(options, device_loop=False), None)
    device = WorkerRunner("ctypes", dict(options, device_loop=True), None)
    rows: list[dict] = []
    try:
        host.start()
        device.start()
        runners = {("in-process", "per-step"): _in_process(backend, False),
                   ("in-process", "host-loop"): _in_process(backend, False),
                   ("in-process", "device-loop"): _in_process(backend, True),
                   ("worker", "per-step"): host, ("worker", "host-loop"): host, ("worker", "device-loop"): device}
        for b in batches:
            factories, used = {}, {}
            for key, runner in runners.items():  # disjoint KV blocks for the ways sharing a chip
                at = used.get(id(runner) if key[0] == "worker" else "in-process", 0)
                factories[key] = f = JobFactory(info, b, workload, first_block=at)
                used[id(runner) if key[0] == "worker" else "in-process"] = at + f.blocks
            rows += measure(runners, factories, steps, workload, b)
    finally:
        host.close()
        device.close()
        backend.unload()
    publish("bench-backend --loop-steps", args.json,
            [*(("loop_row", r) for r in rows), *(("loop_summary", c) for c in compare(rows))],
            lambda: f"ctypes library {options['library']}: prompt {args.prompt_len} tokens/lane, {args.decode_steps} "
                    f"decode tokens/lane per round; sampling temperature {workload.temperature}, top_p "
                    f"{workload.top_p}, top_k {workload.top_k}, logprobs on; one job in flight\n"
                    + format_table(rows, steps))
    return 0
