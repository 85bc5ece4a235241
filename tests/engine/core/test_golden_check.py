"""Golden-case verdicts (engine.core.golden_check): each case field respected, a reason for every failure."""

from __future__ import annotations

from engine.core.golden_check import Outcome, Status, check_case, check_cases, expected_outcome, golden_request

EOS = (9,)
CASE = {"name": "c", "prompt": [1, 2], "max_tokens": 4, "tokens": [5, 9, 6, 7], "temperature": 0.0,
        "ignore_eos": True}


def test_the_request_carries_the_case_fields():
    assert golden_request(CASE) == {"prompt": [1, 2], "max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    old = {"prompt": [1], "max_tokens": 2, "tokens": [3, 4]}  # older packages: greedy, EOS ignored
    assert golden_request(old) == {"prompt": [1], "max_tokens": 2, "ignore_eos": True, "temperature": 0.0}
    sampled = dict(CASE, temperature=0.7, seed=3, top_k=5, top_p=0.9)
    assert golden_request(sampled) == {"prompt": [1, 2], "max_tokens": 4, "ignore_eos": True, "temperature": 0.7,
                                       "seed": 3, "top_k": 5, "top_p": 0.9}


def test_exact_tokens_and_length_finish_pass():
    v = check_case(CASE, Outcome((5, 9, 6, 7), "length"), EOS, name="c")
    assert (v.status, v.reason, v.ok) == (Status.PASS, "", True)


def test_a_diverging_token_fails_naming_the_position():
    v = check_case(CASE, Outcome((5, 9, 8, 7), "length"), EOS)
    assert v.status is Status.FAIL and not v.ok
    assert v.reason == "token 2: expected 6, got 8"
    short = check_case(CASE, Outcome((5, 9), "eos"), EOS)
    assert short.status is Status.FAIL and "2 tokens, expected 4 (next expected 6)" in short.reason
    extra = check_case(dict(CASE, tokens=[5], max_tokens=1), Outcome((5, 1), "length"), EOS)
    assert "extra 1 at 1" in extra.reason


def test_the_finish_reason_is_checked_too():
    v = check_case(CASE, Outcome((5, 9, 6, 7), "stop"), EOS)
    assert v.status is Status.FAIL and v.reason == "finish_reason 'stop', expected 'length'"


def test_without_ignore_eos_the_output_ends_before_the_first_eos():
    case = dict(CASE, ignore_eos=False)
    assert expected_outcome(case, EOS) == ((5,), "eos")
    assert check_case(case, Outcome((5,), "eos"), EOS).status is Status.PASS
    assert check_case(case, Outcome((5, 9, 6, 7), "length"), EOS).status is Status.FAIL
    assert expected_outcome(case, (42,)) == ((5, 9, 6, 7), "length")  # no EOS among the tokens


def test_a_failed_request_is_a_failed_case():
    v = check_case(CASE, Outcome(error="400 out_of_range: prompt: token id 300 >= vocab 260"), EOS)
    assert v.status is Status.FAIL and v.reason.startswith("request failed: 400 out_of_range") and v.got is None


def test_a_sampled_case_without_seed_is_skipped_not_passed():
    v = check_case(dict(CASE, temperature=0.8), Outcome((5, 9, 6, 7), "length"), EOS)
    assert v.status is Status.SKIP and "without a seed" in v.reason
    assert check_case(dict(CASE, temperature=0.8, seed=1), Outcome((5, 9, 6, 7), "length"), EOS).status \
        is Status.PASS


def test_a_near_tie_mismatch_is_inconclusive_only_below_the_callers_tie_gap():
    case = dict(CASE, min_top2_gap=0.01)
    wrong = Outcome((5, 9, 8, 7), "length")
    assert check_case(case, wrong, EOS).status is Status.FAIL  # default tie_gap 0: strict
    v = check_case(case, wrong, EOS, tie_gap=0.05)
    assert v.status is Status.SKIP and "near-tie" in v.reason and "token 2" in v.reason
    assert check_case(dict(CASE, min_top2_gap=0.2), wrong, EOS, tie_gap=0.05).status is Status.FAIL


def test_the_report_passes_only_with_no_failure_and_at_least_one_pass():
    cases = [CASE, dict(CASE, name=None, tokens=[1, 1, 1, 1])]
    good, bad = Outcome((5, 9, 6, 7), "length"), Outcome((5, 9, 6, 7), "length")
    r = check_cases(cases, [good, bad], EOS)
    assert [v.name for v in r.verdicts] == ["c", "case1"]  # unnamed cases are named by position
    assert not r.ok and r.first_failure().name == "case1"
    assert r.to_dict() == {"ok": False, "cases": 2, "passed": 1, "failed": 1, "skipped": 0,
                           "summary": "1/2 golden cases passed, 1 failed"}
    assert check_cases([CASE], [good], EOS).ok
    skipped = check_cases([dict(CASE, temperature=1.0)], [good], EOS)
    assert not skipped.ok and skipped.summary.endswith("none was conclusive")
    empty = check_cases([], [], EOS)
    assert not empty.ok and "no golden cases" in empty.summary
