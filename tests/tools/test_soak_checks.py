"""The soak's checks without a daemon: the leak verdict's sensitivity and the per-request invariants."""

from __future__ import annotations

import random

from tools.load.wire_load import Trace
from tools.soak.mix import Template, check
from tools.soak.resources import LeakThresholds, Sample, leak_verdict, theil_sen

BASE = {"daemon_anon_rss": 30 << 20, "workers_anon_rss": 60 << 20, "shm_bytes": 256 << 20, "daemon_fds": 40,
        "workers_fds": 20, "daemon_threads": 5, "workers_threads": 4, "children": 2, "shm_objects": 6}


def _samples(per_request: dict, n: int = 120, rate: float = 50.0, noise_bytes: int = 300_000, seed: int = 1,
             steps: bool = True) -> list[Sample]:
    """n samples one second apart, `rate` requests/s; memory jitters and steps like CPython's allocator."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        reqs = int(i * rate)
        v = dict(BASE)
        for k, slope in per_request.items():
            v[k] = BASE[k] + slope * reqs
        v["daemon_anon_rss"] += rng.randrange(-noise_bytes, noise_bytes)
        v["workers_anon_rss"] += rng.randrange(-noise_bytes, noise_bytes)
        if steps and i > 30 and i % 40 == 0:
            BASE_STEP = 1 << 20  # an arena grows once in a while, then stays
            v["daemon_anon_rss"] += BASE_STEP
        out.append(Sample(float(i), reqs, v))
    return out


def test_no_leak_under_allocator_noise():
    v = leak_verdict(_samples({}))
    assert v["enough_samples"] and not v["leak"], v


def test_one_kilobyte_per_request_is_flagged():
    # 6,000 requests in two minutes at 1 KB each: the growth the soak must catch.
    v = leak_verdict(_samples({"daemon_anon_rss": 1024}))
    assert v["leak"] and v["daemon_anon_rss"]["leak"]
    assert 900 < v["daemon_anon_rss"]["per_request"] < 1150
    assert not v["workers_anon_rss"]["leak"]


def test_small_growth_below_the_threshold_is_not_flagged():
    v = leak_verdict(_samples({"daemon_anon_rss": 100}))
    assert not v["leak"]


def test_a_leaking_fd_per_few_hundred_requests_is_flagged_and_a_transient_one_is_not():
    v = leak_verdict(_samples({"daemon_fds": 1 / 300}))
    assert v["daemon_fds"]["leak"] and v["leak"]
    s = _samples({})
    for x in s[60:64]:
        x.values["daemon_fds"] += 3  # a burst of connections that closes again
    assert not leak_verdict(s)["leak"]


def test_growth_that_levels_off_is_not_a_leak():
    s = _samples({})
    for x in s:  # pages of a fixed-size array touched for the first time until t = 70 s, then flat
        x.values["workers_anon_rss"] += min(x.requests, 3500) * 1500
    v = leak_verdict(s)
    assert v["workers_anon_rss"]["per_request"] > 512 and not v["leak"], v["workers_anon_rss"]


def test_warmup_growth_is_ignored():
    s = _samples({})
    for x in s[:25]:  # the first fifth grows fast (caches filling), then flat
        x.values["daemon_anon_rss"] -= (25 - x.t) * 400_000
    assert not leak_verdict(s, LeakThresholds(warmup_fraction=0.25))["leak"]


def test_theil_sen_ignores_one_step():
    xs = list(range(100))
    ys = [10.0] * 50 + [1e6] + [10.0] * 49
    assert theil_sen(xs, ys) == 0


def test_too_few_samples_give_no_verdict():
    assert leak_verdict(_samples({}, n=5)) == {"enough_samples": False}


T = Template(0, "plain", (1, 2, 3), 4, 7, 0.0, 0, 1.0)


def _trace(kind, tokens, *terminals, after=0):
    tr = Trace("r", kind, {"max_tokens": 4})
    tr.tokens = list(tokens)
    tr.terminals = list(terminals)
    tr.after_terminal = after
    return tr


def _done(reason, n):
    return {"ev": "done", "finish_reason": reason, "usage": {"completion_tokens": n}}


def test_check_accepts_the_right_answers():
    assert check(_trace("normal", [5, 6, 7, 8], _done("length", 4)), T, [5, 6, 7, 8]) == []
    assert check(_trace("cancel", [5, 6], _done("cancelled", 2)), T, [5, 6, 7, 8]) == []
    assert check(_trace("deadline", [5], {"ev": "error", "code": 504}), T, [5, 6, 7, 8]) == []


def test_check_flags_each_violation():
    assert "crosstalk" in check(_trace("normal", [5, 6, 9, 8], _done("length", 4)), T, [5, 6, 7, 8])[0]
    assert "2 terminal events" in check(_trace("normal", [5, 6, 7, 8], _done("length", 4), _done("length", 4)),
                                        T, None)[0]
    assert "after the terminal" in check(_trace("normal", [5, 6, 7, 8], _done("length", 4), after=1), T, None)[0]
    assert "no terminal event" in check(_trace("normal", [5]), T, None)[0]
    assert "error 500" in check(_trace("normal", [], {"ev": "error", "code": 500, "reason": "x"}), T, None)[0]
    assert "error 504" in check(_trace("cancel", [], {"ev": "error", "code": 504, "reason": "x"}), T, None)[0]
    assert "completion_tokens" in check(_trace("normal", [5, 6, 7, 8], _done("length", 3)), T, None)[0]
    assert "3 of 4" in check(_trace("normal", [5, 6, 7], _done("length", 3)), T, None)[0]
    assert "finish_reason 'cancelled'" in check(_trace("normal", [5], _done("cancelled", 1)), T, None)[0]
