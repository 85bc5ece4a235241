"""`npuserve bench-structured`: its verdicts and metric reading (the servers' runs are in docs/benchmarks.md)."""

from __future__ import annotations

from tools.bench.serve.structured import SCHEMAS, _mask_us_per_step, compare, parse_args


def test_targets_are_judged_on_the_medians_over_rounds():
    def row(label, rnd, tok_s, tpot_p99):
        return {"label": label, "round": rnd, "tokens_per_s": tok_s, "tpot_p99_ms": tpot_p99}

    rows = [row("npuserve", 1, 100.0, 50.0), row("npuserve+schema", 1, 95.0, 52.0), row("llama.cpp+schema", 1, 80, 60),
            row("npuserve", 2, 100.0, 50.0), row("npuserve+schema", 2, 85.0, 70.0), row("llama.cpp+schema", 2, 80, 60),
            row("npuserve", 3, 100.0, 50.0), row("npuserve+schema", 3, 92.0, 55.0), row("llama.cpp+schema", 3, 80, 60)]
    by = {c["baseline"]: c for c in compare(rows)}
    assert by["npuserve"]["ratio"] == 0.92 and by["npuserve"]["met"]
    assert by["llama.cpp+schema"]["ratio"] == round(55 / 60, 3) and by["llama.cpp+schema"]["met"]
    assert [c["baseline"] for c in compare(rows[:2] + rows[3:5])] == ["npuserve"]  # no peer: one verdict


def test_mask_time_per_step_comes_from_the_workers_counters():
    text = ("# HELP npuserve:constraint_masks_total x\n"
            'npuserve:constraint_masks_total{model_name="m"} 400.0\n'
            'npuserve:constraint_mask_seconds_total{model_name="m"} 0.02\n')
    assert _mask_us_per_step(text) == 50.0
    assert _mask_us_per_step("") is None


def test_the_schema_mix_compiles_and_the_defaults_are_the_issues_workload():
    from engine.daemon.constraint_cache import grammar_of

    assert all(grammar_of("json_schema", s) for s in SCHEMAS)
    a = parse_args([])
    assert a.concurrency == 8 and not a.no_peer
