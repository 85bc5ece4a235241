"""The figures the core exposes for metrics (docs/observability.md): queue depth and oldest wait per class,
lane waste per profile, token and prefix-cache counters, lanes and timing on actions. Fake clock."""

from __future__ import annotations

from engine.core.actions import FailRequest, SubmitJob
from engine.core.scheduler_config import SchedulerConfig
from ipc.records import JobKind
from test_scheduler_fakes import FakeExecutor, make_scheduler, params


def test_queue_depth_and_oldest_wait_per_class():
    # one chip, one job slot: the first prompt runs, the rest queue by class
    s = make_scheduler(SchedulerConfig(max_inflight=1, short_prefill_max_tokens=8, medium_prefill_max_tokens=32,
                                       max_sequences=3))
    ex = FakeExecutor(s)
    ex.submit(1, params(n_prompt=4, seed=1), now=0.0)  # short
    ex.submit(2, params(n_prompt=20, seed=2), now=1.0)  # medium
    ex.submit(3, params(n_prompt=40, seed=3), now=2.0)  # long
    ex.submit(4, params(n_prompt=4, seed=4), now=3.0)  # waits for admission (max_sequences=3)
    ex.handle(s.tick(5.0))
    q = s.queue_stats(7.0)
    assert q["board"]["admission"] == {"depth": 1, "oldest_wait_s": 4.0}  # request 4 arrived at 3.0
    chip = q["0"]
    submitted = [j for _, j in ex.pending]
    assert len(submitted) == 1 and submitted[0].kind is JobKind.PREFILL
    depths = {c: chip[c]["depth"] for c in ("decode", "short", "medium", "long")}
    assert sum(depths.values()) == 2 and depths["decode"] == 0
    for c in ("short", "medium", "long"):
        if chip[c]["depth"]:
            assert chip[c]["oldest_wait_s"] == 2.0  # ready since admission at 5.0
        else:
            assert chip[c]["oldest_wait_s"] == 0.0
    # after the first prefill completes, its request waits in the decode queue from then on
    ex.complete_one(6.0)
    q = s.queue_stats(6.5)
    assert q["0"]["decode"] == {"depth": 1, "oldest_wait_s": 0.5}
    assert s.stats(6.5)["queue_waits"] == q
    assert "queue_waits" not in s.stats()


def test_lane_waste_and_fill_ratio_per_profile():
    s = make_scheduler(SchedulerConfig(max_inflight=64), profiles=(1, 4, 8))
    ex = FakeExecutor(s)
    for i in range(3):
        ex.submit(i, params(max_tokens=3, seed=i))
    ex.run()
    prof = s.profile_stats()
    assert set(prof) == {1, 4, 8}
    # 3 ready sequences ride a B4 profile: one inactive lane per decode job
    b4 = prof[4]
    assert b4["jobs"] >= 1 and b4["slots"] == 4 * b4["jobs"] and b4["lanes"] == 3 * b4["jobs"]
    assert b4["lane_waste"] == b4["jobs"] and b4["fill_ratio"] == 0.75
    assert prof[8] == {"jobs": 0, "lanes": 0, "slots": 0, "lane_waste": 0, "fill_ratio": None}
    decode_jobs = [j for _, j in ex.jobs if j.kind is JobKind.DECODE]
    assert sum(p["jobs"] for p in prof.values()) == len(decode_jobs)
    assert sum(p["lane_waste"] for p in prof.values()) == sum(int(j.batch - j.lane_valid.sum()) for j in decode_jobs)
    assert s.stats()["decode_profiles"] == prof


def test_token_counters_and_prefix_queries():
    s = make_scheduler(SchedulerConfig(max_inflight=4))
    ex = FakeExecutor(s)
    shared = params(n_prompt=40, max_tokens=5, seed=7)
    ex.submit(1, shared)
    ex.run()
    ex.submit(2, shared)  # the same prompt again: its full blocks come from the prefix cache
    ex.run()
    assert s.generation_tokens == 10 == sum(len(t) for t in ex.tokens.values())
    assert s.prompt_tokens == 80
    c = s.stats()["counters"]
    assert c["generation_tokens"] == 10 and c["prompt_tokens"] == 80
    assert c["prefix_query_tokens"] == 80
    assert c["prefix_hit_tokens"] == 32  # two full 16-token blocks of the 40-token prompt


def test_submit_job_names_its_lanes_and_failures_carry_timing():
    s = make_scheduler(SchedulerConfig(max_inflight=4))
    ex = FakeExecutor(s)
    ex.submit(5, params(seed=1, deadline_ms=1000), now=0.0)
    actions = s.tick(0.25)
    (job,) = [a for a in actions if isinstance(a, SubmitJob)]
    assert job.request_ids == [5]
    ex.handle(actions)
    ex.complete_all(0.5)
    out = s.tick(1.5)  # past the deadline while decoding
    (fail,) = [a for a in out if isinstance(a, FailRequest)]
    assert fail.code == 504 and fail.timing["e2e_ms"] == 1500.0 and fail.timing["queue_ms"] == 250.0
    assert fail.timing["ttft_ms"] == 500.0
    rejected = s.submit(6, params(n_prompt=0), 2.0)
    assert isinstance(rejected[0], FailRequest) and rejected[0].timing is None


def test_admission_blocked_says_why_requests_wait():
    from engine.core.scheduler_config import TenantPolicy

    s = make_scheduler(SchedulerConfig(max_inflight=4, max_sequences=1))
    ex = FakeExecutor(s)
    ex.handle(s.tick(0.0))
    assert s.admission_blocked is None  # nobody waits
    ex.submit(1, params(seed=1))
    ex.submit(2, params(seed=2))
    ex.handle(s.tick(0.1))
    assert s.admission_blocked == "max_sequences" and s.stats()["admission_blocked"] == "max_sequences"
    ex.run(0.2)
    assert s.admission_blocked is None

    kv = make_scheduler(SchedulerConfig(max_inflight=4), num_blocks=4, block_size=16)  # 64 tokens of KV
    ex = FakeExecutor(kv)
    ex.submit(1, params(n_prompt=40, max_tokens=8, seed=1))
    ex.submit(2, params(n_prompt=40, max_tokens=8, seed=2))
    ex.handle(kv.tick(0.0))
    assert kv.admission_blocked == "kv"

    capped = make_scheduler(SchedulerConfig(max_inflight=4, tenants={"t": TenantPolicy(max_active_sequences=1)}))
    ex = FakeExecutor(capped)
    ex.submit(1, params(seed=1, tenant="t"))
    ex.submit(2, params(seed=2, tenant="t"))
    ex.handle(capped.tick(0.0))
    assert capped.admission_blocked == "tenant_cap"
