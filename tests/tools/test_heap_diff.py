"""Heap snapshots on SIGUSR2 ($NPUSERVE_TRACEMALLOC) and `npuserve heap-diff` naming the line that grew."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import orjson

from repo_root import ROOT

PROBE = textwrap.dedent("""
    import os, signal, time
    from workers.heap_snapshots import install
    assert install("probe")
    os.kill(os.getpid(), signal.SIGUSR2)
    kept = [bytes(1000 + i % 7) for i in range(3000)]  # GROWS
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.1)
    print(len(kept))
""")


def test_a_process_dumps_on_sigusr2_and_heap_diff_names_the_line_that_grew(tmp_path):
    out = tmp_path / "heap"
    env = {**os.environ, "NPUSERVE_TRACEMALLOC": str(out), "NPUSERVE_TRACEMALLOC_TRIM": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    names = sorted(os.listdir(out))
    pid = names[0].split("-")[1]
    assert names == [f"probe-{pid}-0001.json", f"probe-{pid}-0001.tracemalloc",
                     f"probe-{pid}-0002.json", f"probe-{pid}-0002.tracemalloc"]
    facts = orjson.loads((out / f"probe-{pid}-0002.json").read_bytes())
    assert facts["anon_rss"] > 0 and facts["traced_bytes"] > 3_000_000 and "anon_rss_after_trim" in facts

    d = subprocess.run([sys.executable, "-m", "tools.cli", "heap-diff", "--dir", str(out), "--json", "--top", "3"],
                       cwd=ROOT, capture_output=True, timeout=60)
    assert d.returncode == 0, d.stderr.decode()
    [row] = [orjson.loads(line) for line in d.stdout.splitlines()]
    assert row["role"] == "probe" and row["snapshots"] == 2
    top = row["top"][0]
    grows = PROBE.splitlines().index(next(ln for ln in PROBE.splitlines() if "# GROWS" in ln)) + 1
    assert top["where"] == [f"<string>:{grows}"] and top["size_diff"] > 3_000_000 and top["count_diff"] >= 3000
    assert row["python_heap_diff"] > 3_000_000 and "malloc_in_use_diff" in row


def test_without_the_variable_nothing_is_traced_or_handled():
    code = ("import signal, tracemalloc\nfrom workers.heap_snapshots import install\n"
            "print(install('x'), tracemalloc.is_tracing(), signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPUSERVE_TRACEMALLOC")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert p.stdout.decode().split() == ["False", "False", "True"], p.stderr.decode()
