"""The switching soak's end-of-run tables: rounds, switches and faults, and the leak slopes with verdicts."""

from __future__ import annotations

from typing import IO


def _table(head: list[str], rows: list[list], out: IO[str]) -> None:
    cells = [head, *[[str(c) for c in r] for r in rows]]
    w = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for k, r in enumerate(cells):
        print("  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)), file=out)
        if k == 0:
            print("  ".join("-" * x for x in w), file=out)


def _verdict_rows(scope: str, verdict: dict, metrics: tuple[str, ...] | None = None) -> list[list]:
    if not verdict.get("enough_samples"):
        return [[scope, "(not enough samples)", "", "", "", ""]]
    return [[scope, m, v["per_request"], v["late_per_request"], v["growth"], "LEAK" if v["leak"] else "flat"]
            for m, v in verdict.items() if isinstance(v, dict) and (metrics is None or m in metrics)]


def slope_rows(res: dict) -> list[list]:
    """[scope, metric, per request, second half, fitted growth, verdict] for every fitted metric."""
    rows = _verdict_rows("daemon, every sample", res["leaks"]) + _verdict_rows("per round", res["round_leaks"])
    fitted = [w for w in res["worker_leaks"] if w["enough_samples"]]
    if fitted:
        top = max(fitted, key=lambda w: w["anon_rss_per_request"])
        flagged = [w["pid"] for w in fitted if w["leak"]]
        rows.append([f"workers ({len(fitted)} fitted of {len(res['worker_leaks'])})", "anon_rss (highest)",
                     top["anon_rss_per_request"], top["anon_rss_late_per_request"], top["anon_rss_growth"],
                     f"LEAK {flagged}" if flagged else "flat"])
        fds = max(fitted, key=lambda w: w["fds_growth"])
        rows.append([f"workers ({len(fitted)} fitted)", "fds (highest growth)", "", "", fds["fds_growth"],
                     "LEAK" if any("fds" in w["leaked"] for w in fitted) else "flat"])
    else:
        rows.append(["workers", "(no worker lived long enough to fit)", "", "", "", ""])
    return rows


def print_process_slopes(res: dict, out: IO[str]) -> None:
    """The plain soak's memory slopes: the daemon, the workers summed, and each worker process on its own."""
    rows = _verdict_rows("daemon", res["leaks"], ("daemon_anon_rss", "daemon_fds"))
    rows += _verdict_rows("workers, summed", res["leaks"], ("workers_anon_rss", "workers_fds", "shm_bytes"))
    for w in res.get("worker_leaks", []):
        if w["enough_samples"]:
            rows.append([f"worker pid {w['pid']}", "anon_rss", w["anon_rss_per_request"],
                         w["anon_rss_late_per_request"], w["anon_rss_growth"], "LEAK" if w["leak"] else "flat"])
    print("\nleak slopes per process (bytes per request after warm-up; LEAK: both above the threshold and the "
          "fitted growth over 1 MiB):", file=out)
    _table(["process", "metric", "per request", "second half", "growth", "verdict"], rows, out)
    pc = res.get("piece_cache")
    if pc:
        print(f"piece cache: {pc['entries']} of at most {pc['max_entries']} token ids, {pc['hits']} hits, "
              f"{pc['misses']} misses", file=out)
    for chip, rings in (res.get("ring_layouts") or {}).items():
        print(f"chip {chip} ring layouts (the daemon's ends): " + ", ".join(
            f"{ring} {c['entries']} of at most {c['max_entries']} shapes, {c['hits']} hits, {c['misses']} misses"
            for ring, c in rings.items()), file=out)
    ht = res.get("heap_trim")
    if ht and ht["available"] and ht["interval_s"] > 0:
        print(f"daemon malloc_trim: {ht['trims']} calls (every {ht['interval_s']:g} s) gave back "
              f"{ht['released_bytes'] / 2**20:.1f} MiB, the last {ht['last_released_bytes'] / 2**20:.1f} MiB "
              f"in {ht['last_trim_ms']:.1f} ms (the full collection before it {ht.get('last_collect_ms', 0.0):.1f} ms)", file=out)
    print(file=out)


def print_tables(res: dict, out: IO[str]) -> None:
    print("\nrounds (sampled on a settled board just before each switch, and at the end):", file=out)
    _table(["round", "t_s", "requests", "switches", "faults", "daemon anon MB", "workers anon MB", "fds d+w",
            "daemon threads", "workers", "shm objects", "shm MB"],
           [[r["round"], r["t_s"], r["requests"], r["switches"], r["faults"], r["daemon_anon_rss_mb"],
             r["workers_anon_rss_mb"], f"{r['daemon_fds']}+{r['workers_fds']}", r["daemon_threads"], r["children"],
             r["shm_objects"], r["shm_mb"]] for r in res["rounds"]], out)
    print("\nswitches:", file=out)
    _table(["switch", "op", "t_s", "seconds", "generation", "package", "error"],
           [[s["switch"], s["op"], s["t_s"], s["seconds"], f"{s['old_generation']} -> {s['new_generation']}",
             s["package"], s["error"] or ""] for s in res["switches"]], out)
    print("\nfaults:", file=out)
    _table(["fault", "name", "t_s", "chip", "recovered", "recovery_s", "detail"],
           [[f["fault"], f["name"], f["t_s"], "" if f["chip"] is None else f["chip"], f["recovered"],
             f["recovery_s"], f["detail"]] for f in res["faults"]], out)
    print("\nleak slopes (memory in bytes per request, counts per request; fitted after warm-up):", file=out)
    _table(["scope", "metric", "per request", "second half", "growth", "verdict"], slope_rows(res), out)
    if res.get("per_switch"):
        ps = res["per_switch"]
        print("per switch (slope over the rounds after warm-up, reported, not judged): "
              + ", ".join(f"{m} {v / 2**10:+.1f} KiB" if m in ("daemon_anon_rss", "workers_anon_rss", "shm_bytes")
                          else f"{m} {v:+g}" for m, v in ps.items()), file=out)
    print(file=out)
