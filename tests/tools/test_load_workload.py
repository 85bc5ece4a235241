"""The load generator's workload: length distributions, shared prefixes, tenants, open-loop arrivals."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from tools.load.workload import LengthDist, Tenant, WorkloadSpec, build, parse_tenants


@pytest.mark.parametrize("text", ["fixed", "fixed:", "uniform:5", "normal:1,2,3", "pareto:3,1", "fixed:0",
                                  "uniform:9,3", "normal:x,1", "heavy:64,-1"])
def test_bad_distributions_are_refused_with_an_example(text):
    with pytest.raises(ValueError) as e:
        LengthDist.parse(text)
    assert text in str(e.value)


def test_distributions_draw_what_they_say():
    rng = random.Random(3)
    assert {LengthDist.parse("fixed:17").draw(rng) for _ in range(50)} == {17}
    u = [LengthDist.parse("uniform:10,20").draw(rng) for _ in range(2000)]
    assert min(u) == 10 and max(u) == 20
    n = [LengthDist.parse("normal:200,20").draw(rng, floor=64) for _ in range(4000)]
    assert abs(statistics.mean(n) - 200) < 3 and 15 < statistics.stdev(n) < 25
    # Heavy-tailed: log-normal with median 32, sigma 1.2: the mean sits far above the median and the
    # top 1 % is an order of magnitude above it.
    d = LengthDist.parse("heavy:32,1.2")
    h = sorted(d.draw(rng) for _ in range(20000))
    assert abs(h[len(h) // 2] - 32) <= 2
    assert abs(statistics.mean(h) - d.mean) / d.mean < 0.1 and d.mean == pytest.approx(32 * math.exp(0.72))
    assert h[int(len(h) * 0.99)] > 10 * 32


def test_shared_prefix_mode_gives_n_system_prompts():
    spec = WorkloadSpec(40, LengthDist.parse("fixed:50"), LengthDist.parse("fixed:8"), prefixes=4, prefix_len=32)
    reqs = build(spec)
    heads = {tuple(r.prompt[:32]) for r in reqs}
    assert len(heads) == 4
    assert all(len(r.prompt) == 50 for r in reqs)
    assert len({tuple(r.prompt) for r in reqs}) == 40  # users differ after the prefix


def test_tenant_weights_split_the_requests():
    tenants = parse_tenants("a:3,b:1")
    assert tenants == (Tenant("a", 3.0), Tenant("b", 1.0))
    reqs = build(WorkloadSpec(4000, LengthDist.parse("fixed:4"), LengthDist.parse("fixed:4"), tenants=tenants))
    share = sum(r.tenant == "a" for r in reqs) / len(reqs)
    assert 0.72 < share < 0.78
    assert reqs[0].wire()["tenant"] in ("a", "b")
    with pytest.raises(ValueError):
        parse_tenants("a:0")


def test_open_loop_arrivals_are_poisson_at_the_rate():
    reqs = build(WorkloadSpec(3000, LengthDist.parse("fixed:4"), LengthDist.parse("fixed:4"), rate=50.0))
    gaps = [b.at - a.at for a, b in zip(reqs, reqs[1:])]
    assert all(g >= 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 0.02) < 0.002
    assert abs(statistics.stdev(gaps) - 0.02) < 0.003  # exponential: sd == mean


def test_lengths_fit_the_context_and_text_mode_sends_text():
    spec = WorkloadSpec(50, LengthDist.parse("fixed:3000"), LengthDist.parse("fixed:100"), max_seq=2048, text=True)
    for r in build(spec):
        assert len(r.prompt) + r.max_tokens <= 2048 and r.max_tokens >= 1
        assert r.text is not None and len(r.text) == len(r.prompt) and r.text.isprintable()


def test_same_seed_same_workload():
    spec = WorkloadSpec(20, LengthDist.parse("heavy:16,1"), LengthDist.parse("uniform:1,9"), seed=5)
    assert [(r.prompt, r.max_tokens) for r in build(spec)] == [(r.prompt, r.max_tokens) for r in build(spec)]
