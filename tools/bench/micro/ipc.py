"""`npuserve bench micro ipc`: one-way handoff latency of the shm ring vs other transports.

What one "handoff" includes (the same for every transport, so the comparison
is fair): the writer process holds the payload in a numpy uint8 array; the
clock starts (t0) just before the writer hands it to the transport; it stops
(t1) when the reader process holds a numpy array with the payload's contents
in its own address space, usable as-is, and has touched its first and last
byte. For the ring that is reserve + copy into shared memory + commit +
doorbell, then the reader's wake-up and zero-copy peek (the release is after
t1: the reader would release when it is done with the data). For ZeroMQ it is
send, then recv and np.frombuffer (with copy=False for zero-copy); for
multiprocessing.Queue, put then get (pickle, pipe, unpickle). The floor is an
in-process np.copyto of the same bytes into a preallocated array.

t0 and t1 come from time.perf_counter_ns, which on Linux is CLOCK_MONOTONIC,
one clock for all processes. The writer waits for an acknowledgement (not
timed) before the next handoff, so no handoff queues behind another. The
first 10 % of each series is discarded as warm-up (page faults, lazy setup).
Readers wait the way the serving engine waits: doorbells use their default
spin (50 µs semaphore, none for zmq; --spin-us overrides both) and then park;
ZeroMQ and the queue block in the kernel.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.bench.options import add
from tools.load.report import pct, publish

PAYLOADS = (64, 600_000, 9_700_000)
DEFAULT_ITERS = {64: 2000, 600_000: 300, 9_700_000: 40}
BENCH_PREFIX = "npuserve"
BOARD = "bench"


@dataclass(frozen=True)
class Config:
    transport: str  # shm-ring | zmq-copy | zmq-zerocopy | mp-queue
    doorbell: str | None  # semaphore | zmq | None
    spin_s: float | None  # None: each doorbell's own default
    ring_name: str = ""
    endpoint: str = ""  # zmq data endpoint, zmq doorbell endpoint, or the doorbell semaphore's name
    ack_name: str = ""


def _touch(a: np.ndarray) -> int:
    return int(a[0]) + int(a[-1])


# ---- reader process ----------------------------------------------------------


def _reader_main(cfg: Config, ctl: Any, queue: Any) -> None:
    """Child process: receive handoffs, stamp t1 for each, send the stamps back."""
    import zmq

    from ipc.doorbell import SemaphoreDoorbell, ZmqDoorbell
    from ipc.ring import Ring

    spin = {} if cfg.spin_s is None else {"spin_s": cfg.spin_s}
    ack = SemaphoreDoorbell.attach(cfg.ack_name, spin_s=0.0)
    ring = bell = sock = ctx = None
    if cfg.transport == "shm-ring":
        ring = Ring.attach(cfg.ring_name)
        if cfg.doorbell == "semaphore":
            bell = SemaphoreDoorbell.attach(cfg.endpoint, **spin)
        else:
            bell = ZmqDoorbell.attach(cfg.endpoint, **spin)
    elif cfg.transport.startswith("zmq"):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(cfg.endpoint)
    copy = cfg.transport != "zmq-zerocopy"
    ctl.send("ready")
    sink = 0
    while True:
        cmd = ctl.recv()
        if cmd is None:
            break
        n = int(cmd)
        stamps = np.zeros(n, dtype=np.int64)
        for i in range(n):
            if ring is not None:
                while (rec := ring.peek()) is None:
                    bell.wait(1.0)
                a = rec["p"]
                sink += _touch(a)
                stamps[i] = time.perf_counter_ns()
                ring.release()
            elif sock is not None:
                msg = sock.recv(copy=copy)
                a = np.frombuffer(msg if copy else msg.buffer, dtype=np.uint8)
                sink += _touch(a)
                stamps[i] = time.perf_counter_ns()
            else:
                a = queue.get()
                sink += _touch(a)
                stamps[i] = time.perf_counter_ns()
            ack.ring()
        ctl.send(stamps)
    if ring is not None:
        ring.close()
        bell.close()
    if sock is not None:
        sock.close(0)
        ctx.term()
    ack.close()


# ---- writer side (this process) ------------------------------------------------


def _percentiles(samples_ns: np.ndarray) -> tuple[float, float]:
    """P50 and P99 in µs (the load report's nearest rank), the first tenth of the samples left out as warm-up."""
    keep = (samples_ns[len(samples_ns) // 10 :] / 1e3).tolist()
    return pct(keep, 0.5), pct(keep, 0.99)


def _bench_memcpy(size: int, iters: int) -> tuple[float, float]:
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(src)
    out = np.zeros(iters, dtype=np.int64)
    for i in range(iters):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        out[i] = time.perf_counter_ns() - t0
    return _percentiles(out)


def _bench_transport(transport: str, doorbell: str | None, iters: dict[int, int], spin_s: float | None, tmp: str) -> dict[int, tuple[float, float]]:
    import zmq

    from ipc.doorbell import SemaphoreDoorbell, ZmqDoorbell
    from ipc.ring import Ring

    spawn = mp.get_context("spawn")
    spin = {} if spin_s is None else {"spin_s": spin_s}
    # The writer parks at once while it waits for the (untimed) acknowledgement,
    # so it never spins on a core the reader needs to wake up on.
    ack = SemaphoreDoorbell.create(BENCH_PREFIX, BOARD, "ack", spin_s=0.0)
    ring = bell = sock = ctx = queue = None
    endpoint = ""
    ring_name = ""
    try:
        if transport == "shm-ring":
            ring = Ring.create(BENCH_PREFIX, BOARD, 2 * max(PAYLOADS) + (1 << 20), "bench", prefault=True)
            ring_name = ring.name
            if doorbell == "semaphore":
                bell = SemaphoreDoorbell.create(BENCH_PREFIX, BOARD, "bell", **spin)
                endpoint = bell.name
            else:
                endpoint = f"ipc://{tmp}/bell"
                bell = ZmqDoorbell.create(endpoint, **spin)
        elif transport.startswith("zmq"):
            endpoint = f"ipc://{tmp}/data"
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PAIR)
            sock.bind(endpoint)
        else:
            queue = spawn.Queue()
        cfg = Config(transport, doorbell, spin_s, ring_name, endpoint, ack.name)
        ctl, child_ctl = spawn.Pipe()
        proc = spawn.Process(target=_reader_main, args=(cfg, child_ctl, queue), daemon=True)
        proc.start()
        try:
            if not ctl.poll(60) or ctl.recv() != "ready":
                raise RuntimeError(f"{transport} reader did not start")
            results: dict[int, tuple[float, float]] = {}
            copy = transport != "zmq-zerocopy"
            for size in PAYLOADS:
                n = iters[size]
                src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
                t0s = np.zeros(n, dtype=np.int64)
                ctl.send(n)
                for i in range(n):
                    t0s[i] = time.perf_counter_ns()
                    if ring is not None:
                        ring.write({"p": src}, timeout=10.0)
                        bell.ring()
                    elif sock is not None:
                        sock.send(src, copy=copy)
                    else:
                        queue.put(src)
                    if not ack.wait(30.0):
                        raise RuntimeError(f"{transport}: reader stopped acknowledging")
                if not ctl.poll(60):
                    raise RuntimeError(f"{transport}: no stamps from the reader")
                t1s = ctl.recv()
                results[size] = _percentiles(t1s - t0s)
            ctl.send(None)
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
            ctl.close()
        return results
    finally:
        if queue is not None:
            queue.close()
            queue.join_thread()
        if sock is not None:
            sock.close(0)
            ctx.term()
        if bell is not None:
            bell.close()
            if isinstance(bell, SemaphoreDoorbell):
                bell.unlink()
        if ring is not None:
            ring.close()
            ring.unlink()
        ack.close()
        ack.unlink()


TRANSPORTS: tuple[tuple[str, str | None], ...] = (
    ("shm-ring", "semaphore"),
    ("shm-ring", "zmq"),
    ("zmq-copy", None),
    ("zmq-zerocopy", None),
    ("mp-queue", None),
)


def run(iters: dict[int, int], spin_s: float | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="npuserve-bench-")
    try:
        for transport, doorbell in TRANSPORTS:
            res = _bench_transport(transport, doorbell, iters, spin_s, tmp)
            for size in PAYLOADS:
                p50, p99 = res[size]
                rows.append({"transport": transport, "doorbell": doorbell, "payload_bytes": size, "p50_us": round(p50, 2), "p99_us": round(p99, 2)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for size in PAYLOADS:
        p50, p99 = _bench_memcpy(size, max(iters[size], 20))
        rows.append({"transport": "memcpy", "doorbell": None, "payload_bytes": size, "p50_us": round(p50, 2), "p99_us": round(p99, 2)})
    return rows


def _fmt_size(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f} MB"
    if n >= 1000:
        return f"{n / 1e3:.0f} KB"
    return f"{n} B"


def _p50(rows: list[dict[str, Any]], transport: str, doorbell: str | None, size: int) -> float:
    for r in rows:
        if r["transport"] == transport and r["doorbell"] == doorbell and r["payload_bytes"] == size:
            return float(r["p50_us"])
    raise KeyError((transport, doorbell, size))


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The three targets: big ring vs memcpy (<= 2x), zmq copy vs big ring (>= 4x), small ring p50 (< 30 µs)."""
    big, small = PAYLOADS[-1], PAYLOADS[0]
    ring_big = _p50(rows, "shm-ring", "semaphore", big)
    vs_memcpy = ring_big / _p50(rows, "memcpy", None, big)
    vs_zmq = _p50(rows, "zmq-copy", None, big) / ring_big
    small_p50 = _p50(rows, "shm-ring", "semaphore", small)
    return {"ring_vs_memcpy": round(vs_memcpy, 3), "ring_vs_memcpy_ok": vs_memcpy <= 2,
            "zmq_copy_vs_ring": round(vs_zmq, 3), "zmq_copy_vs_ring_ok": vs_zmq >= 4,
            "small_ring_p50_us": round(small_p50, 2), "small_ring_p50_ok": small_p50 < 30,
            "big_payload_bytes": big, "small_payload_bytes": small}


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| transport | doorbell | payload | p50 (µs) | p99 (µs) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['transport']} | {r['doorbell'] or '-'} | {_fmt_size(r['payload_bytes'])} | {r['p50_us']:.1f} | {r['p99_us']:.1f} |"
        )
    big, small = PAYLOADS[-1], PAYLOADS[0]
    t = targets(rows)
    vs_memcpy, vs_zmq, small_p50 = t["ring_vs_memcpy"], t["zmq_copy_vs_ring"], t["small_ring_p50_us"]

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    lines += [
        "",
        f"ring+semaphore {_fmt_size(big)} vs memcpy:   {vs_memcpy:.2f}x  (target <= 2x)   {verdict(vs_memcpy <= 2)}",
        f"zmq-copy vs ring+semaphore {_fmt_size(big)}: {vs_zmq:.2f}x  (target >= 4x)   {verdict(vs_zmq >= 4)}",
        f"ring+semaphore {_fmt_size(small)} p50:        {small_p50:.1f} µs (target < 30 µs) {verdict(small_p50 < 30)}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve bench micro ipc", description=__doc__.split("\n\n")[0])
    add(ap, "json")
    ap.add_argument("--iters", type=int, default=None, help="handoffs per payload size (default: 2000 / 300 / 40 by size)")
    ap.add_argument(
        "--spin-us", type=float, default=None,
        help="doorbell spin before parking, microseconds (default: 50 for the semaphore, 0 for zmq)",
    )
    args = ap.parse_args(argv)
    if args.iters is not None and args.iters < 10:
        ap.error("--iters must be at least 10")
    iters = dict(DEFAULT_ITERS) if args.iters is None else {s: args.iters for s in PAYLOADS}
    t = time.monotonic()
    rows = run(iters, None if args.spin_us is None else args.spin_us * 1e-6)
    elapsed = time.monotonic() - t
    publish("bench-ipc", args.json, [*(("row", r) for r in rows), ("summary", targets(rows))],
            lambda: format_table(rows) + f"\n\n({elapsed:.1f} s, {os.cpu_count()} CPUs; one-way handoff = writer's "
                                         f"array -> reader's usable array)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
