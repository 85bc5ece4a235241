"""`python -m tools.load.tree_ab OLD NEW`: one benchmark command in two source trees, alternately.

For comparisons against an earlier commit (a target such as "≥ 1.2× the
tokens/s of commit X"): each round runs `npuserve bench-serve --backend stub
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
    python -m tools.load.tree_ab /tmp/d992 . --rounds 3 --per-process   # daemon / workers / clients apart
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

from tools.load.paired import alternate

DEFAULT_CMD = "npuserve bench-serve --backend stub --concurrency 64"
# bench-serve's own daemon settings (tools/load/local_daemon.py LOAD_SETTINGS, --max-inflight 2), for
# --per-process, which starts the daemon itself to read its threads' and its workers' CPU times
_DAEMON_SETTINGS = ("admission.max_waiting_requests=100000", "admission.max_waiting_prompt_tokens=1000000000",
                    "executor.max_inflight=2")
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


def _proc_cpu(pid: int) -> float:
    """utime + stime of one process (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def run_per_process(tree: str, python: str, nice: int, concurrency: int) -> dict:
    """bench-serve --endpoint against a daemon started here: CPU per token of the daemon, its workers and
    the client processes (bench-serve's own), apart."""
    from tools.load import local_daemon

    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    daemon = local_daemon.start(backend="stub", chips=2, settings=_DAEMON_SETTINGS, limits=(), prefix="npab-",
                                env=env, wrap=["nice", "-n", str(nice)] if nice else None,
                                board=f"ab{os.getpid() % 100000}", python=python, cwd=tree)
    d, tmp, ep = daemon.proc, daemon.runtime_dir, daemon.endpoint
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(f"{tmp}/d.sock") and len(_children(d.pid)) >= 2):
            if d.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{tree}: the daemon did not start (see {tmp}/daemon.log)")
            time.sleep(0.1)
        time.sleep(1.0)  # the workers' start-up is not the run's
        workers = _children(d.pid)
        before = [_proc_cpu(d.pid)] + [_proc_cpu(w) for w in workers]
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = run_once(tree, [python, "-m", "tools.cli", "bench-serve", "--endpoint", ep, "--concurrency",
                              str(concurrency)], nice)
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # bench-serve and its clients, reaped in run_once
        after = [_proc_cpu(d.pid)] + [_proc_cpu(w) for w in workers]
    finally:
        daemon.stop()
    res["daemon_s"] = after[0] - before[0]
    res["workers_s"] = sum(after[1:]) - sum(before[1:])
    res["clients_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.load.tree_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the baseline tree (e.g. a `git worktree` of the earlier commit)")
    ap.add_argument("new", help="the tree under test")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cmd", default=DEFAULT_CMD, help=f"the command run in each tree (default: {DEFAULT_CMD})")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter for `npuserve` (its `-m tools.cli`), the same for both trees")
    ap.add_argument("--nice", type=int, default=0, help="run each command under `nice -n N`")
    ap.add_argument("--per-process", action="store_true",
                    help="start the stub daemon here (bench-serve's settings) and run `bench-serve --endpoint` "
                         "against it, to split the CPU per token into daemon, workers and clients")
    ap.add_argument("--concurrency", type=int, default=64, help="with --per-process")
    a = ap.parse_args(argv)
    words = a.cmd.split()
    cmd = [a.python, "-m", "tools.cli", *words[1:]] if words[0] == "npuserve" else words
    runs: dict[str, list[dict]] = {"old": [], "new": []}

    def one(which: str, r: int, _group) -> None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        if a.per_process:
            res = run_per_process(getattr(a, which), a.python, a.nice, a.concurrency)
        else:
            res = run_once(getattr(a, which), cmd, a.nice)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        per = 1e6 / res["tokens"] if res["tokens"] else float("nan")
        split = ""
        if a.per_process:  # over the run only (the daemon's and workers' start-up left out)
            cpu = res["daemon_s"] + res["workers_s"] + res["clients_s"]
            split = (f" = daemon {res['daemon_s'] * per:.1f} + workers {res['workers_s'] * per:.1f}"
                     f" + clients {res['clients_s'] * per:.1f}")
        res["cpu_us_per_token"] = cpu * per
        runs[which].append(res)
        load = os.getloadavg()[0]
        print(f"round {r + 1} {which}: {res['tok_s']:.1f} tokens/s, {res['cpu_us_per_token']:.1f} us CPU/token"
              f"{split} (load {load:.2f})", flush=True)

    alternate(("old", "new"), a.rounds, one)
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
