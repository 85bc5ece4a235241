"""The host-cost measurement tools: tree_ab's alternation and ratios, core_cost's closed loop."""

from __future__ import annotations

import sys

from tools.load import core_cost, tree_ab

# Stands in for bench-serve: prints its two lines, with a tokens/s each tree names in a file of its own.
_FAKE = ("import pathlib; v = float(pathlib.Path('rate').read_text()); "
         "print('bench-serve: stub backend, 2 chips, concurrency 64, 8 requests (0 errors), 1000 tokens in 1.0 s'); "
         "print(f'  generated tokens/s  {v}')")


def test_tree_ab_runs_each_tree_in_its_own_directory_alternately_and_reports_the_ratio(tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    for d, rate in ((old, 100.0), (new, 125.0)):
        d.mkdir()
        (d / "rate").write_text(str(rate))
        (d / "fake.py").write_text(_FAKE)
    assert tree_ab.main([str(old), str(new), "--rounds", "3", "--cmd", f"{sys.executable} fake.py"]) == 0
    out = capsys.readouterr().out
    order = [ln.split(":")[0].split()[-1] for ln in out.splitlines() if ln.startswith("round")]
    assert order == ["old", "new", "new", "old", "old", "new"]  # the order flips every round
    assert "median 100.0 tokens/s" in out and "median 125.0 tokens/s" in out
    assert "new/old tokens/s: median 1.250, per round 1.25, 1.25, 1.25" in out


def test_core_cost_serves_every_request_of_its_closed_loop():
    r = core_cost.measure(streams=8, requests=12)
    assert r["requests"] == 12 and r["tokens"] > 12 * 100  # outputs of ~256 tokens, every one generated
    assert r["lanes_per_job"] > 1 and r["us_per_token"] > 0
