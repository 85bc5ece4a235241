"""bench-spec's verdicts: counter deltas, paired ratios against both baselines, targets and their distance."""

from __future__ import annotations

from tools.bench.serve.spec import (PEER, PLAIN, SPEC, Row, decode_job_count, format_report, limits, ratios,
                                    spec_delta)


def test_spec_delta_is_the_run_alone() -> None:
    before = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 4, "num_emitted_tokens": 6}
    after = {"num_drafts": 6, "num_draft_tokens": 24, "num_accepted_tokens": 16, "num_emitted_tokens": 22}
    d = spec_delta(before, after)
    assert d["acceptance_rate"] == 0.75 and d["tokens_per_step"] == 4.0
    assert spec_delta(after, after)["acceptance_rate"] is None


def test_ratios_pair_rounds_and_judge_targets() -> None:
    rows = [Row(SPEC, "copy", 1, 1, 30.0, 10, 10, 0.8, 3.0), Row(PLAIN, "copy", 1, 1, 15.0, 20, 10),
            Row(PEER, "copy", 1, 1, 40.0, 8, 9), Row(SPEC, "copy", 1, 2, 28.0, 10, 10, 0.7, 2.8),
            Row(PLAIN, "copy", 1, 2, 16.0, 20, 10), Row(PEER, "copy", 1, 2, 36.0, 8, 9),
            Row(SPEC, "free", 16, 1, 90.0, 10, 10, 0.1, 1.1), Row(PLAIN, "free", 16, 1, 100.0, 10, 10)]
    rs = {(x["workload"], x["streams"], x["baseline"]): x for x in ratios(rows)}
    plain = rs[("copy", 1, PLAIN)]
    assert plain["ratio"] == round(29.0 / 15.5, 3) and plain["met"] and plain["round_ratios"] == [2.0, 1.75]
    assert plain["acceptance_rate"] == 0.75
    peer = rs[("copy", 1, PEER)]
    assert not peer["met"] and peer["distance"] < 0
    free = rs[("free", 16, PLAIN)]
    assert free["ratio"] == 0.9 and not free["met"]
    text = format_report(rows, list(rs.values()))
    assert "MISSED by" in text and "acceptance 0.75" in text


def test_the_bound_comes_from_mixed_jobs_too() -> None:
    """On llamacpp every decode step is a mixed job: the bound (tokens per job over cost per job, speculating
    against plain) must come from them, not stay empty because no plain decode job ran."""
    assert decode_job_count({"decode_jobs": 0, "mixed_jobs": 40}) == 40
    spec = Row(SPEC, "copy", 1, 1, 30.0, 10, 10, 0.8, 3.0)
    plain = Row(PLAIN, "copy", 1, 1, 15.0, 20, 10)
    spec.decode_jobs, spec.device_s, spec.generated = 20, 3.0, 64   # 3.2 tokens a job at 0.15 s
    plain.decode_jobs, plain.device_s, plain.generated = 64, 6.4, 64  # 1 token a job at 0.1 s
    (lim,) = limits([spec, plain], ratios([spec, plain]))
    assert lim.bound == round((64 / 20) / ((3.0 / 20) / (6.4 / 64)), 3)  # 3.2 / 1.5
