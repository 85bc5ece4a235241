"""ModelState transitions and the ModelTable (routing, publish, drains, capacity, rollback) with a fake clock."""

import pytest

from engine.core.model_state import ALLOWED, ModelState, check_transition
from engine.core.model_table import DrainVerdict, LifecycleError, ModelTable, Need, RouteOutcome

M = ModelState


def ready(table: ModelTable, alias: str, package: str, now: float = 0.0, kind: str = "load", need=None):
    rec = table.begin(alias, package, kind, now)
    rec.path = "/root/" + package
    rec.need = need
    for s in (M.CONFIGURING, M.WARMING):
        table.transition(rec, s)
    table.publish(rec, now)
    return rec


def test_every_state_has_a_row_and_terminal_states_go_nowhere():
    assert set(ALLOWED) == set(ModelState)
    assert ALLOWED[M.UNLOADED] == ALLOWED[M.FAILED] == frozenset()
    for old, news in ALLOWED.items():
        for new in ModelState:
            if new in news:
                assert check_transition(old, new) is new
            else:
                with pytest.raises(AssertionError):
                    check_transition(old, new)


def test_ready_cannot_skip_draining_and_warming_cannot_skip_golden():
    with pytest.raises(AssertionError):
        check_transition(M.READY, M.UNLOADED)
    with pytest.raises(AssertionError):
        check_transition(M.CONFIGURING, M.READY)


def test_routing_default_named_unknown_and_loading():
    t = ModelTable("tiny")
    assert t.route(None).outcome is RouteOutcome.UNAVAILABLE  # nothing loaded yet
    a = ready(t, "tiny", "a")
    assert t.route(None).generation is a and t.route("tiny").generation is a
    r = t.route("other")
    assert r.outcome is RouteOutcome.UNKNOWN and "'tiny'" in r.message
    t.begin("other", "b", "load", 1.0)
    assert t.route("other").outcome is RouteOutcome.UNAVAILABLE  # loading: 503, retry


def test_publish_flips_the_alias_and_pinned_generation_stays_routable_by_record():
    t = ModelTable("tiny")
    g1 = ready(t, "tiny", "a")
    g2 = t.begin("tiny", "b", "replace", 1.0)
    assert t.route("tiny").generation is g1  # until published, the old one serves
    for s in (M.CONFIGURING, M.WARMING):
        t.transition(g2, s)
    prev = t.publish(g2, 2.0)
    assert prev is g1 and t.route("tiny").generation is g2
    t.begin_drain(g1, 2.0, 5.0)
    assert t.route("tiny").generation is g2  # draining the old one does not take the alias away


def test_one_admin_op_per_alias_at_a_time_and_load_of_a_loaded_alias_is_refused():
    t = ModelTable("tiny")
    ready(t, "tiny", "a")
    with pytest.raises(LifecycleError) as e:
        t.begin("tiny", "b", "load", 0.0)
    assert e.value.code == 409 and "replace" in e.value.message
    g = t.begin("tiny", "b", "replace", 0.0)
    with pytest.raises(LifecycleError) as e:
        t.begin("tiny", "c", "replace", 0.0)
    assert e.value.reason == "busy"
    t.fail(g, "verify", "tampered")
    assert g.state is M.FAILED and g.step == "verify" and "tiny" not in t.busy
    assert t.generations[g.id] is g  # listed with its error until the alias's next op
    g2 = t.begin("tiny", "c", "replace", 1.0)
    assert g.id not in t.generations and g2.id in t.generations
    t.fail(g2, "golden", "differs")
    with pytest.raises(LifecycleError) as e:
        t.begin("nope", "x", "replace", 0.0)
    assert e.value.code == 404


def test_unload_takes_the_alias_away_at_once_and_drain_ends_on_empty_or_deadline():
    t = ModelTable("tiny")
    g = ready(t, "tiny", "a")
    t.begin_drain(g, 10.0, 5.0)
    assert t.route("tiny").outcome is RouteOutcome.UNAVAILABLE  # 503 while it drains
    assert t.next_deadline() == 15.0
    assert t.drain_verdict(g, 11.0, active=2, inflight_jobs=1) is DrainVerdict.WAIT
    assert t.drain_verdict(g, 12.0, active=0, inflight_jobs=0) is DrainVerdict.DONE
    assert t.drain_verdict(g, 15.0, active=1, inflight_jobs=0) is DrainVerdict.DEADLINE
    assert t.drain_verdict(g, 15.0, active=1, inflight_jobs=1) is DrainVerdict.RECOVER
    t.transition(g, M.RECOVERING)
    t.transition(g, M.UNLOADING)
    t.transition(g, M.UNLOADED)
    t.forget(g)
    assert t.generations == {}
    assert t.route("tiny").outcome is RouteOutcome.UNKNOWN  # unloaded: not served here (404)
    assert t.route(None).outcome is RouteOutcome.UNAVAILABLE  # no default model: 503


def test_capacity_refusal_names_the_numbers_and_ignores_what_is_excluded():
    mib = 1 << 20
    t = ModelTable("tiny", budget_bytes=100 * mib)
    need = Need(chips=2, weights_bytes=20 * mib, kv_blocks=10, kv_block_bytes=mib)  # 60 MiB
    g1 = ready(t, "tiny", "a", need=need)
    g2 = t.begin("b", "b", "load", 0.0)
    why = t.refuse_capacity(g2, need)
    assert why is not None
    assert "60.0 MiB" in why and "100.0 MiB" in why and "40.0 MiB is free" in why and "tiny gen 1" in why
    assert t.refuse_capacity(g2, Need(1, 20 * mib, 10, mib)) is None  # 30 MiB fits
    assert t.refuse_capacity(g2, need, excluding=(g1.id,)) is None
    assert ModelTable("x").refuse_capacity(g2, need) is None  # no budget


def test_rollback_goes_to_the_previous_package_and_back_again():
    t = ModelTable("tiny")
    with pytest.raises(LifecycleError):
        t.rollback_package("tiny")
    ready(t, "tiny", "a", kind="startup")
    with pytest.raises(LifecycleError) as e:
        t.rollback_package("tiny")
    assert e.value.reason == "no_previous"
    g2 = t.begin("tiny", "b", "replace", 1.0)
    g2.path = "/root/b"
    for s in (M.CONFIGURING, M.WARMING):
        t.transition(g2, s)
    t.publish(g2, 1.0)
    assert t.rollback_package("tiny") == ("a", "/root/a")
    g3 = t.begin("tiny", "a", "rollback", 2.0)
    g3.path = "/root/a"
    for s in (M.CONFIGURING, M.WARMING):
        t.transition(g3, s)
    t.publish(g3, 2.0)
    assert t.history["tiny"] == [("a", "/root/a")]
    with pytest.raises(LifecycleError):
        t.rollback_package("tiny")  # rolled back as far as it goes
