"""`npuserve bench-kv-transfer`: the KV transfer path against a memcpy, and the promote/recompute break-even.

In one process, on the `ref` backend: a KV_EXPORT job of N blocks into the
host slot pool and a KV_IMPORT job of them into other blocks, through the
worker's own code (`workers.kv_transfer.HostKv`: swap_out, one record per
block with its header and CRC-32, then the checks and swap_in), against
`np.copyto` of the same bytes (the floor). Repeated, alternating, medians.
Then the cost model's break-even prefix length per backend (`TierPolicy`):
the fewest tokens whose promotion is expected to beat recomputing them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from tools.json_lines import emit

TARGET = 2.0  # export + import of 1,000 blocks <= 2x a memcpy of the same bytes (issue 22)


def measure(blocks: int, repeats: int) -> dict:
    from engine.core.tier_transfers import HOST, chain_words
    from ipc.kv_slots import KvSlotPool, record_bytes
    from ipc.records import Job, JobKind
    from workers.backends.ref import RefBackend
    from workers.kv_transfer import HostKv

    be = RefBackend(num_blocks=2 * blocks)
    be.load(None)
    info = be.describe()
    rng = np.random.default_rng(0)
    be.cache.k[:] = rng.standard_normal(be.cache.k.shape, dtype=np.float32)
    be.cache.v[:] = rng.standard_normal(be.cache.v.shape, dtype=np.float32)
    pool = KvSlotPool.create("npuservebench", "0", blocks, record_bytes(info.kv.block_bytes()))
    try:
        host = HostKv(pool, be, info)
        chains = [i.to_bytes(16, "little") for i in range(blocks)]

        def job(kind, src, dst):
            j = Job.kv_copy(1, 1, src, dst, kind=kind)
            j.tokens = chain_words(chains)
            j.positions = np.full(blocks, HOST, np.int32)
            return j

        exp = job(JobKind.KV_EXPORT, np.arange(blocks), np.arange(blocks))
        imp = job(JobKind.KV_IMPORT, np.arange(blocks), np.arange(blocks, 2 * blocks))
        nbytes = blocks * info.kv.block_bytes()
        src = np.frombuffer(rng.bytes(nbytes), np.uint8)
        dst = np.empty_like(src)
        t_exp, t_imp, t_cpy = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            host.run(exp)
            t1 = time.perf_counter()
            host.run(imp)
            t2 = time.perf_counter()
            np.copyto(dst, src)
            t3 = time.perf_counter()
            t_exp.append(t1 - t0)
            t_imp.append(t2 - t1)
            t_cpy.append(t3 - t2)
        ok = np.array_equal(be.swap_out(np.arange(blocks)), be.swap_out(np.arange(blocks, 2 * blocks)))
    finally:
        pool.close()
        pool.unlink()
    e, i, c = (statistics.median(x) for x in (t_exp, t_imp, t_cpy))
    return {"blocks": blocks, "bytes": nbytes, "export_ms": round(e * 1e3, 3), "import_ms": round(i * 1e3, 3),
            "memcpy_ms": round(c * 1e3, 3), "round_trip_vs_memcpy": round((e + i) / c, 2),
            "round_trip_vs_two_memcpy": round((e + i) / (2 * c), 2), "bytes_equal": ok,
            "target": f"export+import <= {TARGET}x memcpy", "met": (e + i) / c <= TARGET}


def break_even() -> list[dict]:
    from engine.core.kv.tier_policy import TransferCost
    from workers.backends.ref import RefBackend
    from workers.backends.sim import SimBackend
    from workers.backends.stub import StubBackend

    out = []
    for name, be in (("ref", RefBackend()), ("sim", SimBackend()), ("stub", StubBackend())):
        be.load(None)
        info = be.describe()
        c = info.kv_transfer
        cost = TransferCost(c.base_s, c.per_block_s, c.prefill_s_per_token)
        blocks = cost.break_even_blocks(info.kv.block_size)
        out.append({"backend": name, "block_size": info.kv.block_size, "transfer_base_s": c.base_s,
                    "transfer_per_block_s": c.per_block_s, "prefill_s_per_token": c.prefill_s_per_token,
                    "break_even_tokens": None if blocks is None else round(blocks * info.kv.block_size, 1)})
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve bench-kv-transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    row = measure(a.blocks, a.repeats)
    even = break_even()
    if a.json:
        emit("row", row)
        for r in even:
            emit("break_even", r)
        emit("summary", {"met": row["met"], "round_trip_vs_memcpy": row["round_trip_vs_memcpy"],
                         "target": row["target"]})
        return 0
    print(f"ref: {row['blocks']} blocks, {row['bytes'] / 2**20:.1f} MiB: export {row['export_ms']} ms, import "
          f"{row['import_ms']} ms, memcpy {row['memcpy_ms']} ms")
    print(f"  export+import = {row['round_trip_vs_memcpy']}x one memcpy ({row['round_trip_vs_two_memcpy']}x two); "
          f"target <= {TARGET}x: {'met' if row['met'] else 'MISSED'}; bytes equal: {row['bytes_equal']}")
    for r in even:
        be = "never" if r["break_even_tokens"] is None else f"{r['break_even_tokens']} tokens"
        print(f"break-even prefix ({r['backend']}): promote beats recompute from {be}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
