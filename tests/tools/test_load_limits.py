"""Figure beside the model of its limit: the models, the one way they are printed, and the benchmarks' use."""

from __future__ import annotations

import json

from tools.bench.serve import busy, spec
from tools.bench.serve.spec import PEER, PLAIN, SPEC, Row
from tools.load import limits as lim
from tools.load.report import publish


def test_busy_bound_is_the_ratio_at_no_idle_time_and_none_left_at_busy_one() -> None:
    half = lim.busy("tok/s", 0.9, 0.6, ">= 1.03x")
    assert half.bound == 1.5 and half.of_bound == 0.6
    full = lim.busy("tok/s", 0.9, 1.0, ">= 1.03x")
    assert full.bound == 0.9 and full.of_bound == 1.0  # at the limit: only less work per token helps
    assert lim.busy("tok/s", 0.9, None, "x").bound is None


def test_speculation_expects_tokens_per_step_over_cost_per_step() -> None:
    x = lim.speculation("copy", 1.15, 2.4, 1.6, ">= 1.5x")
    assert x.bound == 1.5 and x.of_bound == round(1.15 / 1.5, 3)


def test_a_latency_floor_is_close_when_the_figure_is_low() -> None:
    x = lim.latency_floor("gap", 0.4, 0.2, "a plain step", "<= 0.3x")
    assert x.of_bound == 0.5 and x.to_dict()["better"] == "lower"


def test_publish_prints_figure_bound_and_target_as_text_and_json_lines(capsys) -> None:
    limits = [lim.pingpong("sim pingpong / sync", 0.94, 1.0, ">= 0.97x"), lim.unmodelled("flood", 0.02, "holds", "-")]
    assert publish("t", False, [], lambda: "rows", limits=limits) == 0
    out = capsys.readouterr().out
    assert "rows" in out and "sim pingpong / sync" in out and ">= 0.97x" in out and "0.940" in out
    publish("t", True, [("row", {"a": 1})], lambda: "", limits=limits)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["kind"] for x in lines] == ["row", "limit", "limit"]
    assert lines[1]["bound"] == 1.0 and lines[1]["figure"] == 0.94 and lines[2]["bound"] is None


def _busy_row(mode: str, tps: float, device_busy: float) -> dict:
    return {"backend": "sim", "mode": mode, "tokens_per_s": tps, "device_busy": device_busy}


def test_bench_busy_bounds_pingpong_by_the_idle_time_of_one_in_flight() -> None:
    rows = [_busy_row("sync", 100.0, 0.8), _busy_row("pingpong", 110.0, 0.95), _busy_row("queued", 105.0, 0.9)]
    (x,) = busy.limits(rows, ["sim"], ["sync", "queued", "pingpong"], host_ms=0.0)
    assert x.figure == 1.1 and x.bound == 1.25 and x.target == ">= 0.97x" and "host_ms=0" in x.measure
    assert busy.limits(rows, ["sim"], ["sync", "pingpong"], host_ms=4.0)[0].target == ">= 1.10x"


def test_bench_spec_expectation_comes_from_the_runs_jobs() -> None:
    rows = [Row(SPEC, "copy", 1, 1, 30.0, 10, 10, 0.8, 3.0, decode_jobs=50, device_s=1.5, generated=100),
            Row(PLAIN, "copy", 1, 1, 15.0, 20, 10, decode_jobs=100, device_s=2.0, generated=100),
            Row(PEER, "copy", 1, 1, 20.0, 8, 9)]
    (x,) = spec.limits(rows, spec.ratios(rows))
    # 2 tokens per job against 1, at 1.5x the device time of a plain job: expected 2 / 1.5
    assert x.inputs["tokens_per_step"] == 2.0 and x.inputs["cost_per_step"] == 1.5
    assert x.bound == round(2 / 1.5, 3) and x.figure == 2.0 and x.inputs["vs_llama_cpp_ngram"] == 1.5


def test_bench_spec_prints_the_daemons_measured_step_cost() -> None:
    t = {"lanes": 1, "plain_step_us": 20000.0, "cost_in_steps": {"1": 1.4, "2": None, "4": 2.6}, "per_draft": 0.4}
    text = spec.format_step_cost(t)
    assert "k=1 1.40" in text and "k=4 2.60" in text and "k=2" not in text and "0.4 steps per draft" in text
    assert "not reported" in spec.format_step_cost(None)


def test_bench_peer_bounds_tokens_per_s_by_chip_busy_with_the_work_per_token_beside() -> None:
    from tools.bench.serve import peer

    def row(engine: str, rnd: int, tps: float, **kw) -> peer.Row:
        return peer.Row(engine, 32, "plain", tps, 1.0, 2.0, 3.0, 4.0, rnd, **kw)

    rows = [row("npuserve", 0, 90.0, chip_busy=1.0, prompt_tokens_per_token=2.5, lane_steps_per_token=1.0,
                lanes_per_job=12.0, prompt_tokens_per_job=300.0, preemptions=3),
            row("llama.cpp", 0, 100.0, prompt_tokens_per_token=2.0, lane_steps_per_token=1.0)]
    (x,) = peer.limits(rows, peer.ratio_rows(rows))
    assert x.figure == 0.9 and x.bound == 0.9 and x.of_bound == 1.0  # busy all the time: at its limit
    assert x.inputs["prompt_tokens_per_token"] == 2.5 and x.inputs["llama_cpp_prompt_tokens_per_token"] == 2.0
    assert x.inputs["preemptions"] == 3 and x.target == ">= 1.03x"
