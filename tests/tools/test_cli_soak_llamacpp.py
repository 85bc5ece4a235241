"""`npuserve soak` on a `llamacpp` board (the tiny model as a GGUF): no violation, no leak, the token cache bounded.

The real-model soak of Gemma 3 270M found the daemon's memory growing with
every new token of its 262,144-id vocabulary: the text bytes of each
generated token were cached without a bound that mattered (an LRU of 2^18
entries in front of a tokenizer that kept its own dict of every token it
had seen). The tiny GGUF's vocabulary is too small for that growth to reach
the soak's 1 MiB leak floor within a CI run, so the bound itself is checked
here: with `model.piece_cache_entries = 16` and fresh prompts (many more
distinct tokens than 16 generated), the board's cache ends at 16 entries
after thousands of misses, while the soak's own leak verdict (a slope per
request after warm-up, daemon and each worker) finds nothing. The same holds
for the other cache that grew on Gemma's soak, the daemon's ends of the
chip's rings (`board.ring_layout_cache_entries`: prompt chunks of new
lengths are new record shapes): bounded to 8, they end at 8 after many more.
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT

BOUND = 16
RING_BOUND = 8


@pytest.mark.integration
def test_llamacpp_soak_has_no_violation_no_leak_and_a_bounded_token_cache():
    # One chip with one llama.cpp thread (the machine's cores are shared); a generous heartbeat: a starved
    # worker restarted mid-run would fail its lanes, and heartbeats are chaos's subject, not this test's.
    # A KV pool of 128 blocks (2,048 cells, 0.5 MiB of llama.cpp KV): the worker's RSS grows as llama.cpp
    # first touches its KV cells (4 MiB for the package's 1,024 blocks, more than 20 s of load touch), which
    # is warm-up, not a leak; a small pool is touched through within the warm-up.
    p = subprocess.run([sys.executable, "-m", "tools.cli", "soak", "--json", "--backend", "llamacpp", "--chips", "1",
                        "--duration", "20s", "--interval", "5s", "--fresh-prompts", "--long-prompt", "256",
                        "--set", f"model.piece_cache_entries={BOUND}", "--set", "board.threads_per_chip=1", "--set", "kv.num_blocks=128",
                        "--set", f"board.ring_layout_cache_entries={RING_BOUND}",
                        "--set", "recovery.heartbeat_timeout_ms=20000",
                        # A collection every second: in a 20 s run CPython's free lists of freed tuples fill
                        # (0.67 MB here, 377 B a request), which a slower machine would spread over fewer
                        # requests up to the verdict's 1 MiB floor; emptied, the daemon's fit is what it
                        # keeps (52 B a request, 92 kB).
                        "--set", "board.malloc_trim_interval_s=1"],
                       cwd=ROOT, capture_output=True, timeout=300)
    out = [orjson.loads(line) for line in p.stdout.splitlines()]
    err = p.stderr.decode()
    verdict = out[-1]
    assert verdict["kind"] == "verdict", err[-3000:]
    assert verdict["backend"] == "llamacpp"
    assert verdict["violations"] == [] and (verdict["lost"], verdict["duplicated"]) == (0, 0), verdict["violations"]
    assert verdict["requests"] > 50
    assert set(verdict["errors_by_code"]) <= {"504"}  # only the short-deadline requests may fail
    leaks = verdict["leaks"]
    flagged = {k: v for k, v in leaks.items() if isinstance(v, dict) and v["leak"]}
    assert leaks["enough_samples"] and not flagged, flagged
    [worker] = verdict["worker_leaks"]
    assert worker["enough_samples"] and not worker["leak"], worker
    assert verdict["verdict"] == "pass" and p.returncode == 0
    # The token cache stopped at its bound although far more distinct lookups missed it.
    pc = verdict["piece_cache"]
    assert pc["max_entries"] == BOUND and pc["entries"] <= BOUND, pc
    assert pc["misses"] > 10 * BOUND, pc
    assert "leak slopes per process" in err and f"piece cache: {pc['entries']} of at most {BOUND}" in err
    # The daemon's ends of the chip's rings kept at most 8 record shapes, of the many more jobs it wrote (a
    # result's shape repeats far more often than a job's).
    (rings,) = verdict["ring_layouts"].values()
    for end in (rings["job"], rings["result"]):
        assert end["max_entries"] == RING_BOUND and end["entries"] <= RING_BOUND, rings
    assert rings["job"]["misses"] > 10 * RING_BOUND, rings
    assert f"job {rings['job']['entries']} of at most {RING_BOUND} shapes" in err
