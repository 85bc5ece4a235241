"""`python -m tools.load.tree_ab OLD NEW`: one benchmark command in two source trees, alternately.

For comparisons against an earlier commit (issue 23's "≥ 1.2× the tokens/s
of d992c98"): each round runs `npuserve bench-serve --backend stub
--concurrency 64` (or `--cmd`) once in each tree, with the tree as working
directory and PYTHONPATH, in the same interpreter; the order flips every
round (ABBA...), so a drift of the machine hits both alike. Per run it reads
the "generated tokens/s" and "N tokens" lines bench-serve prints and the CPU
time of the whole process tree (bench-serve's rusage: the daemon, its
workers and the client processes are all its waited-for descendants), and
prints the medians and NEW/OLD ratios. The CPU per token is the steadier
figure on a shared host; tokens/s is the target's.

    git worktree add /tmp/d992 d992c98
    python -m tools.load.tree_ab /tmp/d992 . --rounds 5
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

DEFAULT_CMD = "npuserve bench-serve --backend stub --concurrency 64"
_TOKS_S = re.compile(r"generated tokens/s\s+([\d.]+)")
_TOKENS = re.compile(r"\(\d+ errors\), (\d+) tokens in")


def run_once(tree: str, cmd: list[str], nice: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    argv = ["nice", "-n", str(nice), *cmd] if nice else cmd
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate()
    wall = time.monotonic() - t0
    m, n = _TOKS_S.search(out), _TOKENS.search(out)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"{tree}: `{' '.join(cmd)}` failed (status {p.returncode}):\n{out[-2000:]}")
    return {"tok_s": float(m.group(1)), "tokens": int(n.group(1)) if n else 0, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.load.tree_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the baseline tree (e.g. a `git worktree` of the earlier commit)")
    ap.add_argument("new", help="the tree under test")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cmd", default=DEFAULT_CMD, help=f"the command run in each tree (default: {DEFAULT_CMD})")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter for `npuserve` (its `-m tools.cli`), the same for both trees")
    ap.add_argument("--nice", type=int, default=0, help="run each command under `nice -n N`")
    a = ap.parse_args(argv)
    words = a.cmd.split()
    cmd = [a.python, "-m", "tools.cli", *words[1:]] if words[0] == "npuserve" else words
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(a.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for which in order:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            res = run_once(getattr(a, which), cmd, a.nice)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            res["cpu_us_per_token"] = cpu / res["tokens"] * 1e6 if res["tokens"] else float("nan")
            runs[which].append(res)
            load = os.getloadavg()[0]
            print(f"round {r + 1} {which}: {res['tok_s']:.1f} tokens/s, {res['cpu_us_per_token']:.1f} us CPU/token "
                  f"(load {load:.2f})", flush=True)
    med = {w: (statistics.median(x["tok_s"] for x in rs), statistics.median(x["cpu_us_per_token"] for x in rs))
           for w, rs in runs.items()}
    ratios = [n["tok_s"] / o["tok_s"] for o, n in zip(runs["old"], runs["new"])]
    print(f"old {a.old}: median {med['old'][0]:.1f} tokens/s, {med['old'][1]:.1f} us CPU/token")
    print(f"new {a.new}: median {med['new'][0]:.1f} tokens/s, {med['new'][1]:.1f} us CPU/token")
    print(f"new/old tokens/s: median {med['new'][0] / med['old'][0]:.3f}, per round "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; CPU per token old/new {med['old'][1] / med['new'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
