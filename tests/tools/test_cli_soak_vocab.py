"""`npuserve soak` of a board with a 262,144-id vocabulary (Gemma 3's size): the daemon's memory stays flat.

The stub backend samples its tokens uniformly over the vocabulary it is
given, so with `vocab_size=262144` almost every generated token is an id the
daemon has not seen: the worst case for anything the daemon keeps per token
id. Before `model.piece_cache_entries` bounded the cache of token bytes, the
daemon's anonymous RSS grew ~1.5 KB per request here and the soak's leak
verdict flagged it within seconds; now the cache stops at its 1,024 entries (the default bound).
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT


@pytest.mark.integration
def test_a_large_vocabulary_soak_keeps_the_daemon_flat_and_the_token_cache_at_its_bound():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "soak", "--json", "--backend", "stub", "--chips", "1",
                        "--backend-option", "vocab_size=262144", "--duration", "15s", "--interval", "3s",
                        "--fresh-prompts", "--max-tokens", "64", "--long-prompt", "256",
                        "--set", "recovery.heartbeat_timeout_ms=20000",
                        # A collection every second: CPython's free lists of freed tuples fill during the
                        # first minutes of a busy daemon (~1-2 MB here, 600 B a request over 15 s, enough to
                        # trip the verdict on a slow machine); emptied, the slope is the caches' alone
                        # (~40-90 B a request; the unbounded token cache put back: 3.4 KB).
                        "--set", "board.malloc_trim_interval_s=1"],
                       cwd=ROOT, capture_output=True, timeout=300)
    verdict = orjson.loads(p.stdout.splitlines()[-1])
    assert verdict["kind"] == "verdict", p.stderr.decode()[-3000:]
    assert verdict["violations"] == [] and (verdict["lost"], verdict["duplicated"]) == (0, 0), verdict["violations"]
    assert verdict["checked_against_oracle"] == verdict["requests"] > 100
    daemon = verdict["leaks"]["daemon_anon_rss"]
    assert verdict["leaks"]["enough_samples"] and not daemon["leak"], daemon
    pc = verdict["piece_cache"]
    # Full, and more distinct ids missed than it holds: it evicted rather than grew (how many more depends
    # on the machine's speed over the 15 s).
    assert pc["entries"] == pc["max_entries"] == 1024 and pc["misses"] > 1024, pc
    assert verdict["verdict"] == "pass" and p.returncode == 0
