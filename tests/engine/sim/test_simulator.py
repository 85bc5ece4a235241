"""The in-process simulator: virtual clock, policies, serial shortcut, CLI output."""

from __future__ import annotations

import orjson

from engine.sim import make_workload, predict, simulate
from engine.sim.runner import serial_table
from tools.simulate import main
from workers.backends.sim_latency import LatencyModel

WL = make_workload(24, prompt_mean=128, gen_mean=32, seed=3)


def test_serial_throughput_matches_the_latency_model_exactly():
    lat = LatencyModel()
    r = simulate("serial", 4, WL)
    busy = sum(lat.prefill_seconds(len(w.prompt)) + (w.max_tokens - 1) * lat.decode_seconds(1) for w in WL)
    assert abs(r.makespan_s - busy) < 1e-6
    assert abs(r.throughput_tok_s - sum(w.max_tokens for w in WL) / busy) < 1e-6
    assert abs(r.tpot_mean_ms - lat.decode_seconds(1) * 1000) < 1e-6


def test_serial_shortcut_equals_full_simulation():
    for row in serial_table([1, 3, 8], WL):
        full = simulate("serial", row.concurrency, WL)
        assert abs(row.ttft_p50_ms - full.ttft_p50_ms) < 1e-6
        assert abs(row.ttft_p99_ms - full.ttft_p99_ms) < 1e-6
        assert abs(row.throughput_tok_s - full.throughput_tok_s) < 1e-6


def test_continuous_beats_static_beats_serial_on_throughput():
    rows = {p: simulate(p, 16, WL) for p in ("continuous", "static", "serial")}
    assert rows["continuous"].throughput_tok_s > rows["static"].throughput_tok_s > rows["serial"].throughput_tok_s
    assert rows["continuous"].ttft_p99_ms < rows["static"].ttft_p99_ms


def test_chunked_prefill_cuts_decode_stalls_of_long_prompts():
    wl = make_workload(12, prompt_mean=1800, gen_mean=64, seed=5)
    chunked = simulate("continuous", 8, wl)
    whole = simulate("continuous-nochunk", 8, wl)
    assert chunked.itl_p99_ms < whole.itl_p99_ms


def test_predict_and_cli_json_rows(capsys):
    r = predict(4, requests=8, prompt_mean=64, gen_mean=16)
    assert r.throughput_tok_s > 0 and r.requests == 8
    assert main(["--concurrency", "2,4", "--requests", "8", "--prompt-mean", "64", "--gen-mean", "16",
                 "--json"]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 8  # 4 policies x 2 concurrencies
    for row in rows:
        assert {"policy", "concurrency", "throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms"} <= set(row)
        assert next(iter(row)) == "kind" and row["kind"] == "row"
    assert {row["policy"] for row in rows} == {"continuous", "continuous-nochunk", "static", "serial"}
