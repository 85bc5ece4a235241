"""`npuserve bench-observe --json`: JSON Lines with `kind` (the bench-serve runs faked; `_micro` runs for real)."""

from __future__ import annotations

import orjson

from tools import bench_observe


def test_json_lines_are_rows_then_the_in_process_summary(monkeypatch, capsys):
    figures = {"plain": 1000.0, "metrics": 990.0, "trace": 950.0}

    def fake_run(a, variant, tmp):
        return {"variant": variant, "tokens_per_s": figures[variant], "errors": 0, "tpot_p50_ms": 1.0,
                "scrapes": 3 if variant == "metrics" else None, "trace_bytes": 1234 if variant == "trace" else None}

    monkeypatch.setattr(bench_observe, "_serve_run", fake_run)
    assert bench_observe.main(["--json", "--rounds", "1"]) == 0
    lines = [orjson.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert all(next(iter(x)) == "kind" for x in lines)
    assert [x["kind"] for x in lines] == ["row", "row", "row", "summary"]
    rows = {x["variant"]: x for x in lines[:3]}
    assert rows["metrics"]["ratio_to_plain"] == 0.99 and rows["metrics"]["ok"] is True
    assert rows["trace"]["trace_bytes"] == 1234 and rows["plain"]["ok"] is None
    assert lines[3]["variant"] == "in-process" and lines[3]["metrics_us_per_token"] > 0
