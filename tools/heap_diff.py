"""`npuserve heap-diff A B`: what a process's Python heap gained between two heap snapshots, top N by line.

The snapshots are those `NPUSERVE_TRACEMALLOC=DIR` makes a daemon or chip
worker write on SIGUSR2 (`workers.heap_snapshots`); each comes with a
`.json` of the process's anonymous RSS and glibc heap, so the report says
how much of the RSS growth the Python heap explains and how much is native
(`mallinfo2` in use) or allocator slack (free but kept). `--dir DIR` diffs,
for every process in DIR, its first snapshot against its last (or the
`--from`-th against the `--to`-th).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tracemalloc

_NAME = re.compile(r"^(?P<role>.+)-(?P<pid>\d+)-(?P<seq>\d+)\.tracemalloc$")


def snapshots_by_process(directory: str) -> dict[tuple[str, int], list[str]]:
    """(role, pid) -> that process's snapshot paths in order."""
    out: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            out.setdefault((m["role"], int(m["pid"])), []).append((int(m["seq"]), os.path.join(directory, name)))
    return {k: [p for _, p in sorted(v)] for k, v in sorted(out.items())}


def _facts(snapshot_path: str) -> dict:
    try:
        with open(snapshot_path[:-len(".tracemalloc")] + ".json") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def diff(a_path: str, b_path: str, top: int = 15, key: str = "lineno", frames: int = 1) -> dict:
    """The growth from snapshot A to B: totals, and the `top` lines (or tracebacks) that grew most."""
    a = tracemalloc.Snapshot.load(a_path)
    b = tracemalloc.Snapshot.load(b_path)
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = b.filter_traces(ignore).compare_to(a.filter_traces(ignore), key)
    fa, fb = _facts(a_path), _facts(b_path)
    rows = []
    for st in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:top]:
        where = [f"{f.filename}:{f.lineno}" for f in st.traceback[:frames]] if key == "traceback" else \
            [f"{st.traceback[0].filename}:{st.traceback[0].lineno}"]
        rows.append({"where": where, "size_diff": st.size_diff, "count_diff": st.count_diff, "size": st.size})
    out = {"a": a_path, "b": b_path, "python_heap_diff": sum(s.size_diff for s in stats),
           "python_objects_diff": sum(s.count_diff for s in stats), "top": rows}
    if fa and fb:
        out["anon_rss_diff"] = fb.get("anon_rss", 0) - fa.get("anon_rss", 0)
        ma, mb = fa.get("mallinfo2") or {}, fb.get("mallinfo2") or {}
        if ma and mb:
            out["malloc_in_use_diff"] = (mb["uordblks"] + mb["hblkhd"]) - (ma["uordblks"] + ma["hblkhd"])
            out["malloc_free_kept_diff"] = mb["fordblks"] - ma["fordblks"]
        if "anon_rss_after_trim" in fb:
            out["anon_rss_after_trim"] = fb["anon_rss_after_trim"]
    return out


def format_diff(d: dict, title: str = "") -> str:
    lines = [f"{title or os.path.basename(d['b'])}: Python heap {d['python_heap_diff'] / 1024:+.1f} KiB "
             f"({d['python_objects_diff']:+d} objects)"
             + (f", anon RSS {d['anon_rss_diff'] / 1024:+.1f} KiB" if "anon_rss_diff" in d else "")
             + (f", malloc in use {d['malloc_in_use_diff'] / 1024:+.1f} KiB, free kept "
                f"{d['malloc_free_kept_diff'] / 1024:+.1f} KiB" if "malloc_in_use_diff" in d else "")]
    for r in d["top"]:
        lines.append(f"  {r['size_diff'] / 1024:+10.1f} KiB {r['count_diff']:+8d} objects  {r['where'][0]}")
        lines += [f"{'':40}{w}" for w in r["where"][1:]]
    return "\n".join(lines)


def diff_directory(directory: str, top: int = 15, first: int = 0, last: int = -1, key: str = "lineno",
                   frames: int = 1) -> list[dict]:
    """For every process with at least two snapshots in `directory`: its `first`-th against its `last`-th."""
    out = []
    for (role, pid), paths in snapshots_by_process(directory).items():
        if len(paths) < 2:
            continue
        d = diff(paths[first], paths[last], top, key, frames)
        out.append({"role": role, "pid": pid, "snapshots": len(paths), **d})
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="npuserve heap-diff", description=__doc__.split("\n\n")[0])
    p.add_argument("snapshots", nargs="*", metavar="SNAPSHOT", help="two .tracemalloc files: A then B")
    p.add_argument("--dir", help="diff every process's snapshots in this directory instead")
    p.add_argument("--from", dest="first", type=int, default=0, help="with --dir: index of the first snapshot")
    p.add_argument("--to", dest="last", type=int, default=-1, help="with --dir: index of the last snapshot")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--traceback", type=int, default=0, metavar="FRAMES",
                   help="group by allocation traceback and show this many frames (default: by line)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    key, frames = ("traceback", a.traceback) if a.traceback > 0 else ("lineno", 1)
    if a.dir:
        diffs = diff_directory(a.dir, a.top, a.first, a.last, key, frames)
        if not diffs:
            print(f"npuserve heap-diff: no process in {a.dir} has two snapshots", file=sys.stderr)
            return 1
    elif len(a.snapshots) == 2:
        diffs = [diff(a.snapshots[0], a.snapshots[1], a.top, key, frames)]
    else:
        p.error("give two snapshots, or --dir DIR")
    for d in diffs:
        if a.json:
            from tools.json_lines import emit

            emit("heap_diff", d)
        else:
            title = f"{d['role']} (pid {d['pid']}, {d['snapshots']} snapshots)" if "role" in d else ""
            print(format_diff(d, title))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
