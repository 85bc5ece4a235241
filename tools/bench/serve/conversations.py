"""`npuserve bench serve --conversations N --turns T`: multi-turn conversations against KV tier configurations.

Each turn's prompt is the whole conversation so far plus a new user message,
so every turn after the first repeats a prefix the board computed before.
With the device pool made small (`--device-blocks`), N conversations do not
fit on the chips: their prefixes are evicted between turns and either
recomputed (device only) or promoted from the host or disk tier. One daemon
per tier configuration, the same conversations for each, side by side:

* device: prefix cache on the chips only;
* host:   + the board's host pool (`kv.host_pool_mb`);
* disk:   + the disk tier (`kv.disk_dir`, a fresh directory);
* disk-only: the disk tier without a host pool (every hit is a block file read).

Per configuration: TTFT P50/P99 (the server's `timing.ttft_ms`), prompt
tokens computed (prompt - cached), the hit rate, and the tier counters.

`--restart` adds the restart replay on the disk configuration: the last
turn of every conversation is sent again to the warm daemon, the daemon is
stopped (SIGTERM) and started again on the same `kv.disk_dir`, and the same
prompts are replayed; a fresh device-only daemon gives the cold start.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import threading
import time

from tools.load.report import publish


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("conversations (--conversations N)")
    g.add_argument("--conversations", type=int, default=0, help="multi-turn mode: this many conversations ...")
    g.add_argument("--turns", type=int, default=4, help="... of this many turns each")
    g.add_argument("--first-len", type=int, default=96, help="tokens of a conversation's first message")
    g.add_argument("--turn-len", type=int, default=32, help="tokens of each later user message")
    g.add_argument("--answer-len", type=int, default=16, help="max_tokens of every turn")
    g.add_argument("--device-blocks", type=int, default=96, help="kv.num_blocks per chip (make it small)")
    g.add_argument("--host-mb", type=int, default=64, help="kv.host_pool_mb of the host configuration")
    g.add_argument("--tiers", default="device,host,disk", help="configurations to run, comma separated")
    g.add_argument("--restart", action="store_true", help="also the restart replay on the disk configuration")


def _conversations(n: int, a: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Per conversation, the user messages of each turn (fixed by the seed)."""
    rng = random.Random(a.seed)
    return [[[rng.randrange(1, vocab) for _ in range(a.first_len if t == 0 else a.turn_len)]
             for t in range(a.turns)] for _ in range(n)]


def _drive(endpoint: str, convs: list[list[list[int]]], concurrency: int, answer_len: int,
           seed: int) -> tuple[list[dict], list[list[int]]]:
    """Run the conversations turn by turn: every conversation's turn t (`concurrency` at a time) before any
    turn t+1, as many users chatting at once; returns the records and each conversation's last prompt."""
    from engine.client import Client

    out: list[dict] = []
    lock = threading.Lock()
    histories: list[list[int]] = [[] for _ in convs]
    last: list[list[int]] = [[] for _ in convs]
    clients = [Client(endpoint, timeout=600) for _ in range(concurrency)]
    try:
        for t in range(len(convs[0])):
            todo = list(range(len(convs)))

            def worker(c) -> None:
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop(0)
                    history = histories[i]
                    history += convs[i][t]
                    last[i] = list(history)
                    r = c.generate(history, max_tokens=answer_len, ignore_eos=True, seed=seed + i)
                    with lock:
                        out.append({"conv": i, "turn": t, "prompt": len(history),
                                    "cached": r.usage.get("cached_tokens", 0), "ttft_ms": r.timing.get("ttft_ms")})
                    history += r.tokens

            threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
    finally:
        for c in clients:
            c.close()
    return out, last


def _replay(endpoint: str, prompts: list[list[int]], answer_len: int) -> list[dict]:
    from engine.client import Client

    out = []
    with Client(endpoint, timeout=600) as c:
        for p in prompts:
            r = c.generate(p, max_tokens=answer_len, ignore_eos=True)
            out.append({"prompt": len(p), "cached": r.usage.get("cached_tokens", 0), "ttft_ms": r.timing.get("ttft_ms")})
    return out


def _pct(xs: list[float], q: float) -> float | None:
    from tools.load.report import pct

    v = pct(xs, q / 100)
    return None if v is None else round(v, 2)


def _summary(label: str, recs: list[dict], tiers: dict | None) -> dict:
    later = [r for r in recs if r["turn"] > 0] if recs and "turn" in recs[0] else recs
    prompt = sum(r["prompt"] for r in recs)
    cached = sum(r["cached"] for r in recs)
    c = (tiers or {}).get("counters", {})
    return {"kind": "conversations", "label": label, "requests": len(recs),
            "ttft_p50_ms": _pct([r["ttft_ms"] for r in recs if r["ttft_ms"] is not None], 50),
            "ttft_p99_ms": _pct([r["ttft_ms"] for r in recs if r["ttft_ms"] is not None], 99),
            "ttft_p50_later_turns_ms": _pct([r["ttft_ms"] for r in later if r["ttft_ms"] is not None], 50),
            "prompt_tokens": prompt, "prompt_tokens_computed": prompt - cached,
            "hit_rate": round(cached / prompt, 3) if prompt else None,
            "host_hit_blocks": c.get("hit_host_blocks", 0), "disk_hit_blocks": c.get("hit_disk_blocks", 0),
            "promoted_blocks": c.get("promoted_blocks", 0), "misses": {k[5:]: v for k, v in c.items()
                                                                       if k.startswith("miss_")}}


def _start(a: argparse.Namespace, settings: list[str]):
    from tools.load import local_daemon

    d = local_daemon.start(backend=a.backend, chips=a.chips, settings=[*a.set, *settings],
                           backend_options=a.backend_option, prefix="npc-")
    model = local_daemon.wait_healthy(d.endpoint, d)["model"]
    return d, model


def _tiers_of(endpoint: str) -> dict | None:
    from tools.load import local_daemon

    return (local_daemon.stats(endpoint).get("scheduler") or {}).get("kv_tiers")


def run(a: argparse.Namespace) -> int:
    configs = [t.strip() for t in a.tiers.split(",") if t.strip()]
    bad = [t for t in configs if t not in ("device", "host", "disk", "disk-only")]
    if bad:
        sys.stderr.write(f"bench: --tiers takes device, host, disk, disk-only; not {bad}\n")
        return 2
    disk_root = tempfile.mkdtemp(prefix="npc-kv-", dir="/tmp")
    base = [f"kv.num_blocks={a.device_blocks}", f"executor.max_inflight={a.max_inflight}", "kv.promote=\"cost\""]
    per = {"device": [], "host": [f"kv.host_pool_mb={a.host_mb}"],
           "disk": [f"kv.host_pool_mb={a.host_mb}", f"kv.disk_dir=\"{disk_root}\""],
           "disk-only": [f"kv.disk_dir=\"{disk_root}-only\""]}
    rows: list[dict] = []
    concurrency = max(1, min(a.concurrency, a.conversations))
    convs = None
    restart: dict | None = None
    try:
        for name in configs:
            d, model = _start(a, base + per[name])
            try:
                if convs is None:
                    convs = _conversations(a.conversations, a, min(model["vocab_size"], 256))
                t0 = time.monotonic()
                recs, finals = _drive(d.endpoint, convs, concurrency, a.answer_len, a.seed)
                row = _summary(name, recs, _tiers_of(d.endpoint))
                row["seconds"] = round(time.monotonic() - t0, 2)
                rows.append(row)
                if name == "disk" and a.restart:  # the last turns again: what a restarted board should have
                    warm = _replay(d.endpoint, finals, a.answer_len)
                    restart = {"warm": warm, "finals": finals}
            finally:
                code = d.stop()
                if code != 0:
                    sys.stderr.write(f"bench: daemon exited {code}; log tail:\n{d.log_tail()}\n")
                d.cleanup()
        if restart is not None:
            d, _ = _start(a, base + per["disk"])
            try:
                replay = _replay(d.endpoint, restart["finals"], a.answer_len)
                warm_log = d.log_tail(20000)
            finally:
                d.stop()
                d.cleanup()
            d, _ = _start(a, base)
            try:
                cold = _replay(d.endpoint, restart["finals"], a.answer_len)
            finally:
                d.stop()
                d.cleanup()
            p = {k: _pct([r["ttft_ms"] for r in v], 50) for k, v in
                 (("warm", restart["warm"]), ("replay", replay), ("cold", cold))}
            rows.append({"kind": "restart", "ttft_p50_warm_ms": p["warm"], "ttft_p50_replay_ms": p["replay"],
                         "ttft_p50_cold_ms": p["cold"],
                         "replay_vs_warm": round(p["replay"] / p["warm"], 2) if p["warm"] else None,
                         "cold_vs_replay": round(p["cold"] / p["replay"], 2) if p["replay"] else None,
                         "first_replay_cached_tokens": replay[0]["cached"] if replay else None,
                         "warm_start_logged": "kv_disk_warm" in warm_log,
                         "target": "replay <= 1.5x warm, cold >= 3x replay"})
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
        shutil.rmtree(disk_root + "-only", ignore_errors=True)
    _print(a, rows)
    return 0


def _print(a: argparse.Namespace, rows: list[dict]) -> None:
    def text() -> str:
        out = [f"conversations {a.conversations} x {a.turns} turns on {a.backend}, {a.chips} chip(s), "
               f"{a.device_blocks} device blocks per chip",
               f"{'tiers':9} {'TTFT p50':>9} {'p99':>9} {'later p50':>9} {'computed':>9} {'of prompt':>9} "
               f"{'hit rate':>8} {'host hit':>8} {'disk hit':>8}"]
        for r in rows:
            if r["kind"] == "conversations":
                out.append(f"{r['label']:9} {r['ttft_p50_ms']:>9} {r['ttft_p99_ms']:>9} "
                           f"{r['ttft_p50_later_turns_ms']:>9} {r['prompt_tokens_computed']:>9} {r['prompt_tokens']:>9} "
                           f"{r['hit_rate']:>8} {r['host_hit_blocks']:>8} {r['disk_hit_blocks']:>8}")
        for r in rows:
            if r["kind"] == "restart":
                out.append(f"restart: TTFT p50 warm {r['ttft_p50_warm_ms']} ms, replay after restart "
                           f"{r['ttft_p50_replay_ms']} ms ({r['replay_vs_warm']}x warm; target <= 1.5x), cold "
                           f"{r['ttft_p50_cold_ms']} ms ({r['cold_vs_replay']}x the replay; target >= 3x)")
        return "\n".join(out)

    publish("bench", a.json, [(r["kind"], {k: v for k, v in r.items() if k != "kind"}) for r in rows], text)


