"""`npuserve soak` of a board with a 262,144-id vocabulary (Gemma 3's size): the token cache stays at its bound.

The stub backend samples its tokens uniformly over the vocabulary it is
given, so with `vocab_size=262144` almost every generated token is an id the
daemon has not seen: the worst case for anything the daemon keeps per token
id. Before `model.piece_cache_entries` bounded the cache of token bytes, the
daemon's anonymous RSS grew ~1.5 KB per request here; now the cache stops at
its 1,024 entries (the default bound) and evicts.

The soak's own leak verdict is not judged here: over seconds on a busy
machine it also measures CPython's free lists filling, which a slow machine
spreads over fewer requests. The flat-memory claim is the real-model soak's
(docs/soak-and-chaos.md), run for minutes.
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT


@pytest.mark.integration
def test_a_large_vocabulary_soak_keeps_the_token_cache_at_its_bound_and_every_answer_right():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "soak", "--json", "--backend", "stub", "--chips", "1",
                        "--backend-option", "vocab_size=262144", "--duration", "10s", "--interval", "2s",
                        "--fresh-prompts", "--max-tokens", "64", "--long-prompt", "256",
                        "--set", "recovery.heartbeat_timeout_ms=20000"],
                       cwd=ROOT, capture_output=True, timeout=300)
    verdict = orjson.loads(p.stdout.splitlines()[-1])
    assert verdict["kind"] == "verdict", p.stderr.decode()[-3000:]
    assert verdict["violations"] == [] and (verdict["lost"], verdict["duplicated"]) == (0, 0), verdict["violations"]
    assert verdict["checked_against_oracle"] == verdict["requests"] > 0
    pc = verdict["piece_cache"]
    # Full, and more distinct ids missed than it holds (a request of 64 tokens misses ~64): it evicted rather
    # than grew.
    assert pc["entries"] == pc["max_entries"] == 1024 and pc["misses"] > 1024, pc
