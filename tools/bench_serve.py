"""`npuserve bench-serve`: end-to-end serving benchmark through the client library.

Starts a daemon subprocess (or uses `--endpoint`), then drives it closed-loop
at `--concurrency` outstanding streamed requests from several client
processes (so the client is not the bottleneck), with the simulator's
synthetic workload (`engine.sim.make_workload`). Reports delivered generated
tokens/s and TTFT / TPOT percentiles measured at the client; for the `sim`
backend also what the in-process simulator predicts for the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import orjson

# sim runs 4 requests per slot: with 2, the ramp-up and the tail (where the last
# long requests sit on one chip while the other idles) are a large share of a
# ~15 s run, and how they fall varies from run to run by several per cent.
DEFAULTS = {  # per backend: (requests per concurrency slot, prompt_mean, gen_mean)
    "stub": (8, 64, 256),
    "sim": (4, 128, 128),
    "ref": (2, 32, 32),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("stub", "sim", "ref"), default="stub")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, help="total requests (default: a few per concurrency slot)")
    p.add_argument("--prompt-mean", type=int, help="mean prompt tokens")
    p.add_argument("--gen-mean", type=int, help="mean generated tokens")
    p.add_argument("--chips", type=int, default=2)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--endpoint", help="benchmark an already running daemon instead of starting one")
    p.add_argument("--max-inflight", type=int, default=2,
                   help="executor.max_inflight of the daemon (default 2: ping/pong hides the host round trip)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="daemon config override")
    p.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `npuserve serve`, e.g. --daemon-arg=--trace=/tmp/t.json")
    p.add_argument("--json", action="store_true")
    p.add_argument("--_client", help=argparse.SUPPRESS)  # internal: run as a client process (spec on stdin)
    return p.parse_args(argv)


# ---------------------------------------------------------------- client side


async def _drive(endpoint: str, concurrency: int, reqs: list[dict], start_at: float) -> list[list]:
    from engine.async_client import AsyncClient
    from engine.errors import ClientError

    out: list[list] = []
    async with AsyncClient(endpoint, timeout=600) as c:
        await c.health()  # connected before the clock starts
        await asyncio.sleep(max(0.0, start_at - time.time()))
        it = iter(reqs)

        async def worker() -> None:
            for r in it:
                t0 = time.time()
                first = last = None
                n = 0
                err = None
                try:
                    async for chunk in c.stream(r["prompt"], max_tokens=r["max_tokens"], seed=r["seed"],
                                                ignore_eos=True):
                        last = time.time()
                        if first is None:
                            first = last
                        n += len(chunk)
                except ClientError as e:
                    err = e.code
                out.append([t0, first, last, n, err])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def _client_main() -> int:
    spec = orjson.loads(sys.stdin.buffer.read())
    res = asyncio.run(_drive(spec["endpoint"], spec["concurrency"], spec["requests"], spec["start_at"]))
    sys.stdout.buffer.write(orjson.dumps(res))
    return 0


# ---------------------------------------------------------------- orchestration


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(len(xs) * q))], 3)


def _start_daemon(a: argparse.Namespace, tmp: str) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{tmp}/bench.sock"
    cmd = [sys.executable, "-m", "engine.daemon.main", "--backend", a.backend, "--chips", str(a.chips),
           "--runtime-dir", tmp, "--endpoint", endpoint, "--board", "bench",
           "--set", "admission.max_waiting_requests=100000", "--set", "admission.max_waiting_prompt_tokens=1000000000"]
    for kv in a.set:
        cmd += ["--set", kv]
    for kv in a.backend_option:
        cmd += ["--backend-option", kv]
    cmd += a.daemon_arg
    log = open(os.path.join(tmp, "daemon.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return proc, endpoint


def stop_daemon(proc: subprocess.Popen) -> None:
    """SIGTERM the daemon started by `_start_daemon`; SIGKILL when it does not exit within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_health(endpoint: str, proc: subprocess.Popen | None, tmp: str | None, timeout: float = 120) -> dict:
    from engine.client import Client
    from engine.errors import ClientError

    deadline = time.monotonic() + timeout
    with Client(endpoint, timeout=0.5) as c:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = open(os.path.join(tmp, "daemon.log"), errors="replace").read()[-3000:] if tmp else ""
                raise SystemExit(f"bench-serve: daemon exited with {proc.returncode}:\n{tail}")
            try:
                h = c.health()
                if h.get("chips_up"):
                    return h
            except ClientError:
                pass
    raise SystemExit("bench-serve: daemon not healthy in time")


def _predict(a: argparse.Namespace, n: int, prompt_mean: int, gen_mean: int, health: dict):
    """The in-process simulator's run of the same workload and scheduler configuration (sim only)."""
    if a.backend != "sim":
        return None
    from engine.config import load_config
    from engine.core.scheduler_config import scheduler_config_from
    from engine.daemon.main import _pairs
    from engine.sim import predict

    cfg = load_config(None, {"board.backend": "sim", **_pairs(a.set, "--set")})
    sc = scheduler_config_from(cfg)
    m = health["model"]
    return predict(a.concurrency, requests=n, prompt_mean=prompt_mean, gen_mean=gen_mean, chips=a.chips,
                   profiles=tuple(m["profiles"]), max_seq=m["max_seq"], config=sc)


def _stats(endpoint: str) -> dict:
    from engine.client import Client

    with Client(endpoint, timeout=10) as c:
        return c.stats()


_COUNTERS = ("decode_jobs", "decode_lanes", "prefill_jobs", "prefill_tokens")


def _daemon_run(before: dict, after: dict, window_s: float) -> dict:
    """What the chips did during the run (stats deltas): device time per chip vs the window, job mix.

    `device_busy` below 1 is time the chip ran no modelled work: host overhead
    between jobs, start-up and the tail when the chip had nothing left to do.
    """
    b_c, a_c = before["scheduler"]["counters"], after["scheduler"]["counters"]
    counters = {k: a_c.get(k, 0) - b_c.get(k, 0) for k in _COUNTERS}
    b_chips = {c["chip"]: c for c in before["chips"]}
    device = [round(c["device_s"] - b_chips[c["chip"]]["device_s"], 3) for c in after["chips"]]
    worker = [round(c["worker_s"] - b_chips[c["chip"]]["worker_s"], 3) for c in after["chips"]]
    jobs = [after["scheduler"]["chips"][str(c["chip"])]["jobs_submitted"]
            - before["scheduler"]["chips"][str(c["chip"])]["jobs_submitted"] for c in after["chips"]]
    return {"window_s": round(window_s, 3), "device_s": device, "worker_s": worker,
            "device_busy": [round(d / max(window_s, 1e-9), 4) for d in device], "jobs": jobs, **counters,
            "mean_decode_lanes": round(counters["decode_lanes"] / max(counters["decode_jobs"], 1), 2)}


def _sim_run(r) -> dict:
    """The simulator's run in the shape of `_daemon_run` (its window is its makespan from t = 0)."""
    pc = r.per_chip
    counters = {k: sum(c[k] for c in pc) for k in _COUNTERS}
    return {"window_s": round(r.makespan_s, 3), "device_s": [round(c["busy_s"], 3) for c in pc],
            "device_busy": [round(c["busy_s"] / max(r.makespan_s, 1e-9), 4) for c in pc],
            "jobs": [c["decode_jobs"] + c["prefill_jobs"] for c in pc], **counters,
            "mean_decode_lanes": round(counters["decode_lanes"] / max(counters["decode_jobs"], 1), 2)}


def run(a: argparse.Namespace) -> dict:
    from engine.sim import make_workload

    a.set = [f"executor.max_inflight={a.max_inflight}", *a.set]

    per_slot, pm, gm = DEFAULTS[a.backend]
    prompt_mean = a.prompt_mean or pm
    gen_mean = a.gen_mean or gm
    n = a.requests or per_slot * a.concurrency
    tmp = None
    proc = None
    rows: list[list] = []
    try:
        if a.endpoint:
            endpoint = a.endpoint
        else:
            tmp = tempfile.mkdtemp(prefix="npsb-", dir="/tmp")
            proc, endpoint = _start_daemon(a, tmp)
        health = _wait_health(endpoint, proc, tmp)
        stats_before = _stats(endpoint)
        m = health["model"]
        # Exactly the simulator's workload (same lengths); ids folded into the model's vocabulary.
        wl = make_workload(n, prompt_mean, gen_mean, max_seq=m["max_seq"], seed=42)
        v = min(m["vocab_size"], 256)
        reqs = [{"prompt": [t % v for t in r.prompt], "max_tokens": r.max_tokens, "seed": r.index} for r in wl]
        k = max(1, min(a.clients, a.concurrency))
        start_at = time.time() + 1.0 + 0.2 * k
        procs = []
        for i in range(k):
            share = a.concurrency // k + (1 if i < a.concurrency % k else 0)
            spec = {"endpoint": endpoint, "concurrency": share, "requests": reqs[i::k], "start_at": start_at}
            p = subprocess.Popen([sys.executable, "-m", "tools.bench_serve", "--_client", "-"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            p.stdin.write(orjson.dumps(spec))
            p.stdin.close()
            procs.append(p)
        for p in procs:
            out = p.stdout.read()
            p.wait()
            if p.returncode != 0:
                raise SystemExit(f"bench-serve: a client process failed ({p.returncode})")
            rows += orjson.loads(out)
        stats_after = _stats(endpoint)
        sim = _predict(a, n, prompt_mean, gen_mean, health)
    finally:
        if proc is not None:
            stop_daemon(proc)
        if tmp:
            if rows and any(r[4] is not None for r in rows):
                with open(os.path.join(tmp, "daemon.log"), errors="replace") as fh:
                    sys.stderr.write("bench-serve: requests failed; daemon log tail:\n" + fh.read()[-3000:])
            shutil.rmtree(tmp, ignore_errors=True)
    ok = [r for r in rows if r[4] is None]
    errors = len(rows) - len(ok)
    tokens = sum(r[3] for r in ok)
    t_begin = min(r[0] for r in rows)
    t_end = max((r[2] or r[0]) for r in rows)
    ttft = [(r[1] - r[0]) * 1000 for r in ok if r[1] is not None]
    tpot = [(r[2] - r[1]) * 1000 / (r[3] - 1) for r in ok if r[3] > 1]
    predicted = None if sim is None else round(sim.throughput_tok_s, 1)
    return {
        "backend": a.backend, "concurrency": a.concurrency, "requests": len(rows), "errors": errors,
        "tokens_per_s": round(tokens / max(t_end - t_begin, 1e-9), 1),
        "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
        "tpot_p50_ms": _pct(tpot, 0.5), "tpot_p99_ms": _pct(tpot, 0.99),
        "predicted_tokens_per_s": predicted,
        "generated_tokens": tokens, "seconds": round(t_end - t_begin, 3), "chips": a.chips,
        "prompt_mean": prompt_mean, "gen_mean": gen_mean, "client_processes": k, "settings": a.set,
        "error_codes": {str(c): sum(1 for r in rows if r[4] == c) for c in sorted({r[4] for r in rows} - {None})},
        "daemon_run": _daemon_run(stats_before, stats_after, t_end - t_begin),
        "predicted_run": None if sim is None else _sim_run(sim),
    }


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a._client:
        return _client_main()
    res = run(a)
    if a.json:
        sys.stdout.buffer.write(orjson.dumps(res) + b"\n")
    else:
        print(f"bench-serve: {res['backend']} backend, {res['chips']} chips, concurrency {res['concurrency']}, "
              f"{res['requests']} requests ({res['errors']} errors), {res['generated_tokens']} tokens "
              f"in {res['seconds']} s")
        print(f"  generated tokens/s  {res['tokens_per_s']}")
        if res["predicted_tokens_per_s"] is not None:
            pct = 100 * res["tokens_per_s"] / res["predicted_tokens_per_s"]
            print(f"  predicted tokens/s  {res['predicted_tokens_per_s']}  (delivered {pct:.1f} %)")
        print(f"  TTFT p50/p99 ms     {res['ttft_p50_ms']} / {res['ttft_p99_ms']}")
        print(f"  TPOT p50/p99 ms     {res['tpot_p50_ms']} / {res['tpot_p99_ms']}")
        for label, ran in (("daemon", res["daemon_run"]), ("simulator", res["predicted_run"])):
            if ran is not None:
                busy = ", ".join(f"{100 * b:.1f} %" for b in ran["device_busy"])
                print(f"  {label + ':':<11} {ran['window_s']} s, device busy per chip {busy}; "
                      f"{ran['decode_jobs']} decode jobs ({ran['mean_decode_lanes']} lanes), "
                      f"{ran['prefill_jobs']} prefill jobs")
    return 0 if res["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
