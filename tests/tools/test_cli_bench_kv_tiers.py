"""`npuserve bench --conversations` and `npuserve bench-kv-transfer` end to end (smoke), as JSON Lines."""

from __future__ import annotations

import subprocess
import sys

import orjson

from repo_root import ROOT


def _run(*args: str, timeout: float = 300) -> list[dict]:
    p = subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=ROOT, capture_output=True, timeout=timeout)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return [orjson.loads(line) for line in p.stdout.splitlines()]


def test_conversations_per_tier_configuration():
    rows = _run("bench", "--backend", "sim", "--chips", "1", "--backend-option", "time_scale=0.02",
                "--conversations", "6", "--turns", "3", "--concurrency", "2", "--first-len", "64",
                "--turn-len", "16", "--answer-len", "4", "--device-blocks", "16", "--tiers", "device,host",
                "--json")
    by = {r["label"]: r for r in rows}
    assert [r["kind"] for r in rows] == ["conversations", "conversations"] and set(by) == {"device", "host"}
    assert by["device"]["requests"] == by["host"]["requests"] == 18
    assert by["host"]["host_hit_blocks"] > 0
    assert by["host"]["prompt_tokens_computed"] < by["device"]["prompt_tokens_computed"]


def test_transfer_bench_checks_the_bytes_and_prints_break_even():
    objs = _run("bench-kv-transfer", "--blocks", "64", "--repeats", "3", "--json")
    row = objs[0]
    assert row["kind"] == "row" and row["bytes_equal"] is True and row["blocks"] == 64
    even = {o["backend"]: o for o in objs if o["kind"] == "break_even"}
    assert even["stub"]["break_even_tokens"] is None and even["ref"]["break_even_tokens"] > 0
    assert objs[-1]["kind"] == "summary"
