"""The scenarios' request generators and metrics (tools/load/scenarios.py, scenario_metrics.py), on hand-made
traces; the targets live in the benchmark output, not here."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tools.bench.serve.scenario import parse_generated
from tools.load import runner, scenario_metrics as m, scenarios as sc
from tools.load.report import Slo
from tools.load.runner import Record
from tools.load.workload import Request


def rec(i, sent, first=None, gaps=(), tenant="default", error=None, tokens=None, disconnected=False):
    """A record whose token events are at `first` and then `gaps` (ms) apart."""
    gaps = list(gaps)
    last = None if first is None else first + sum(gaps) / 1000.0
    n = tokens if tokens is not None else (0 if first is None else len(gaps) + 1)
    return Record(i, tenant, sent, first, last, n, error, gaps, disconnected)


# ---------------------------------------------------------------- generators


def test_long_prompt_streams_run_in_the_background_and_the_long_prompts_arrive_later():
    s = sc.get("long-prompt")
    opts = s.resolve()
    reqs = s.requests(opts, vocab=1000, max_seq=4096, seed=1)
    streams = [r for r in reqs if r.role == "stream"]
    longs = [r for r in reqs if r.role == "long"]
    assert len(streams) == opts["streams"] * opts["per_stream"] and len(longs) == opts["longs"]
    assert {r.stream for r in streams} == set(range(int(opts["streams"])))
    assert all(r.background and r.at == 0.0 and len(r.prompt) == 64 for r in streams)
    assert all(len(r.prompt) == 1500 and r.at == opts["long_at"] and r.stream is None and not r.background
               and r.after_streams for r in longs)
    assert all(1 <= t < 256 for r in reqs for t in r.prompt)  # ids below 256 whatever the vocabulary
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert s.requests(opts, 1000, 4096, 1)[0].prompt == reqs[0].prompt  # fixed by the seed


def test_long_prompts_are_clipped_to_max_seq():
    s = sc.get("long-prompt")
    reqs = s.requests(s.resolve({"long_prompt": "5000"}), max_seq=2048)
    assert all(len(r.prompt) + r.max_tokens <= 2048 for r in reqs)


def test_tenant_flood_is_a_background_flood_of_a_and_one_stream_of_b():
    s = sc.get("tenant-flood")
    opts = s.resolve(quick=True)
    reqs = s.requests(opts)
    a = [r for r in reqs if r.tenant == "a"]
    b = [r for r in reqs if r.tenant == "b"]
    assert len({r.stream for r in a}) == opts["flood_streams"] and all(r.background for r in a)
    assert len(b) == opts["b_requests"] and {r.stream for r in b} == {int(opts["flood_streams"])}
    assert all(not r.background and r.at == opts["b_at"] for r in b)
    assert all(r.wire()["tenant"] in "ab" for r in reqs)


def test_burst_arrivals_are_poisson_plus_bursts():
    times = sc.burst_arrivals(random.Random(3), rate=2.0, duration=100.0, every=10.0, size=16, spread=0.5)
    assert times == sorted(times) and all(0 <= t < 100.5 for t in times)
    for b in range(10):  # each burst: 16 arrivals within its half second (plus any Poisson one there)
        start = 5.0 + 10 * b
        assert sum(start <= t <= start + 0.5 for t in times) >= 16
    assert 150 <= len(times) - 160 <= 250  # ~200 Poisson arrivals at 2/s over 100 s
    assert sc.burst_arrivals(random.Random(3), 2.0, 100.0, 10.0, 16, 0.5) == times


def test_burst_requests_are_open_loop_with_lengths_in_range():
    s = sc.get("burst")
    opts = s.resolve()
    reqs = s.requests(opts)
    assert all(r.stream is None and 32 <= len(r.prompt) <= 256 and 16 <= r.max_tokens <= 64 for r in reqs)
    assert [r.at for r in reqs] == sorted(r.at for r in reqs)
    assert s.slo_of(opts) == Slo(ttft_ms=3000.0, tpot_ms=200.0)


def test_hangups_cut_every_other_request_short_at_a_point_in_range():
    s = sc.get("hangups")
    opts = s.resolve()
    reqs = s.requests(opts)
    cut = [r for r in reqs if r.disconnect_after is not None]
    assert len(cut) == len(reqs) // 2 and all(r.role == "hangup" for r in cut)
    assert all(4 <= r.disconnect_after <= 48 < r.max_tokens for r in cut)
    assert runner._wire(cut[0])["disconnect_after"] == cut[0].disconnect_after


def test_options_quick_overrides_and_unknown_names():
    s = sc.get("tenant-flood")
    assert s.resolve()["flood_streams"] == 24 and s.resolve(quick=True)["flood_streams"] == 6
    assert s.resolve({"flood_streams": "12"}, quick=True)["flood_streams"] == 12
    with pytest.raises(ValueError, match="unknown option 'floods'"):
        s.resolve({"floods": "3"})
    with pytest.raises(ValueError, match="not a number"):
        s.resolve({"b_at": "soon"})
    with pytest.raises(ValueError, match="--conversations"):
        sc.get("multi-turn")
    with pytest.raises(ValueError, match="long-prompt, tenant-flood, burst, hangups"):
        sc.get("nope")


# ---------------------------------------------------------------- metrics


def test_long_prompt_metrics_take_the_streams_gaps_during_the_long_prefill():
    reqs = [Request(0, [1], 8, 0, stream=0, role="stream"), Request(1, [1], 8, 1, stream=1, role="stream"),
            Request(2, [1] * 100, 2, 2, role="long")]
    recs = [
        rec(0, 0.0, 0.1, [100, 100, 900, 100, 100]),  # tokens at 0.1 .. 0.3, then 1.2, 1.3, 1.4
        rec(1, 0.0, 0.15, [100, 100, 700, 200, 100]),  # 0.15 .. 0.35, then 1.05, 1.25, 1.35
        rec(2, 0.5, 1.1, [50]),  # the long prompt: sent at 0.5, first token at 1.1
    ]
    out = m.long_prompt(recs, reqs)
    assert out["window_ms"] == 600.0 and out["streams_cover_window"]
    assert out["worst_gap_ms"] == 900.0  # 0.3 -> 1.2 overlaps [0.5, 1.1]
    assert out["gap_p50_outside_ms"] == 100.0
    assert out["long_ttft_max_ms"] == pytest.approx(600.0) and out["long_ttft_p50_ms"] == pytest.approx(600.0)
    # overlapping [0.5, 1.1]: 0.3 -> 1.2 (stream 0), 0.35 -> 1.05 and 1.05 -> 1.25 (stream 1)
    inside, _ = m.stream_gaps(m.stream_times(recs, reqs), 0.5, 1.1)
    assert sorted(inside) == [200.0, 700.0, 900.0]


def test_a_streams_gaps_run_across_its_back_to_back_requests():
    """A stream whose next request waits behind the long prefill stalls as much as one whose decode
    steps wait: the wait from its last token to the next request's first one is a gap."""
    reqs = [Request(0, [1], 3, 0, stream=0, role="stream"), Request(1, [1], 3, 1, stream=0, role="stream"),
            Request(2, [1] * 100, 2, 2, role="long")]
    recs = [rec(0, 0.0, 0.1, [100, 100]),  # 0.1, 0.2, 0.3
            rec(1, 0.3, 2.3, [100, 100]),  # sent at 0.3, first token at 2.3
            rec(2, 0.5, 2.0, [10])]
    assert m.stream_times(recs, reqs) == [pytest.approx([0.1, 0.2, 0.3, 2.3, 2.4, 2.5])]
    out = m.long_prompt(recs, reqs)
    assert out["worst_gap_ms"] == pytest.approx(2000.0) and out["streams_cover_window"]


def test_long_prompt_metrics_say_when_the_streams_stopped_before_the_window_ended():
    reqs = [Request(0, [1], 4, 0, stream=0, role="stream"), Request(1, [1] * 9, 2, 1, role="long")]
    out = m.long_prompt([rec(0, 0.0, 0.1, [100, 100]), rec(1, 0.2, 2.0, [10])], reqs)
    assert not out["streams_cover_window"]


def test_tenant_flood_metrics_split_by_tenant():
    reqs = []
    recs = [rec(i, 0.0, 1.0 + i, [100] * 9, tenant="a") for i in range(4)]
    recs += [rec(10, 1.0, 1.2, [100], tenant="b"), rec(11, 2.0, 2.4, [100], tenant="b"),
             rec(12, 3.0, 3.1, [100], tenant="b")]
    out = m.tenant_flood(recs, reqs)
    assert out["b_requests"] == 3 and out["b_ttft_p50_ms"] == pytest.approx(200.0)
    assert out["b_ttft_ms"] == [100.0, 200.0, 400.0]
    assert out["a_tokens_per_s"] == pytest.approx(40 / 4.9, abs=0.1)  # 40 tokens from 0.0 to 4.9 s


def test_burst_metrics_count_429s_apart_from_slo_misses():
    slo = Slo(ttft_ms=500, tpot_ms=100)
    recs = [rec(0, 0.0, 0.2, [50] * 9),  # meets it
            rec(1, 0.0, 0.9, [50] * 9),  # TTFT 900: a miss
            rec(2, 0.0, 0.1, [300] * 9),  # TPOT 300: a miss
            rec(3, 0.0, error=429), rec(4, 0.5, error=503)]
    out = m.burst(recs, slo)
    assert (out["slo_met"], out["slo_missed"], out["rejected_429"], out["other_errors"]) == (1, 2, 1, 1)
    assert out["goodput_requests_per_s"] == pytest.approx(1 / out["seconds"], abs=1e-3)
    assert out["slo"] == "ttft=500ms,tpot=100ms"


def test_hangup_metrics_charge_the_server_for_tokens_nobody_received():
    recs = [rec(0, 0.0, 0.1, [10] * 7), rec(1, 0.0, 0.1, [10] * 2, disconnected=True),
            rec(2, 0.0, 0.1, [10] * 3, disconnected=True), rec(3, 0.0, error=500)]
    out = m.hangups(recs, server_generated=8 + 3 + 4 + 3)  # one token each after the two disconnects, +1
    assert out["disconnects"] == 2 and out["delivered_tokens"] == 15
    assert out["wasted_tokens"] == 3 and out["wasted_per_disconnect"] == 1.5
    assert out["others_tpot_p50_ms"] == pytest.approx(10.0)
    assert m.hangups(recs, None)["wasted_per_disconnect"] is None


def test_verdicts_ratio_on_medians_with_paired_rounds_and_absolute_bounds():
    s = sc.get("tenant-flood")
    rows = [{"label": "npuserve", "round": 1, "b_ttft_p50_ms": 100.0, "a_tokens_per_s": 96.0},
            {"label": "llama.cpp", "round": 1, "b_ttft_p50_ms": 1000.0, "a_tokens_per_s": 100.0},
            {"label": "llama.cpp", "round": 2, "b_ttft_p50_ms": 2000.0, "a_tokens_per_s": 100.0},
            {"label": "npuserve", "round": 2, "b_ttft_p50_ms": 200.0, "a_tokens_per_s": 90.0}]
    b, a = sc.verdicts(s, rows, "npuserve", "llama.cpp")
    assert b["value"] == 0.1 and b["met"] and b["margin"] == 0.05 and b["rounds"] == [0.1, 0.1]
    assert a["value"] == pytest.approx(0.93) and not a["met"] and a["within_spread"]  # 0.96 and 0.90
    alone = sc.verdicts(s, rows, "npuserve", None)
    assert all(v["met"] is None and "bench-http-peer" in v["note"] for v in alone)
    h = sc.get("hangups")
    (v,) = sc.verdicts(h, [{"label": "x", "round": 1, "wasted_per_disconnect": 2.5}], "x", None)
    assert v["met"] is False and v["margin"] == -1.5


def test_server_token_counts_from_prometheus_text():
    text = "# HELP x\nllamacpp:prompt_tokens_total 40\nllamacpp:tokens_predicted_total 1234\n"
    assert parse_generated(text) == 1234
    assert parse_generated("npuserve_generation_tokens_total 7.0\n") == 7
    assert parse_generated("other 3\n") is None


# ---------------------------------------------------------------- the runner's scenario mode


def test_client_shares_keep_streams_whole():
    reqs = [Request(i, [1], 1, i, stream=i % 3) for i in range(9)]
    shares = runner._shares(reqs, 2)
    assert all(len({r.stream for r in sh} & {r.stream for r in other}) == 0
               for sh in shares for other in shares if other is not sh)
    reqs[0].background = True  # background streams wait for the foreground: one process holds all
    assert [len(x) for x in runner._shares(reqs, 2)] == [9, 0]


class _GatedDriver:
    """A fake driver for `runner._scheduled`: logs each request's start and end; a request listed in
    `hold` does not finish until `release(index)` says so, so a test decides the order of events
    rather than a clock."""

    def __init__(self, hold=()) -> None:
        self.log: list[tuple[str, int]] = []
        self.gates = {i: asyncio.Event() for i in hold}
        self.started: dict[int, asyncio.Event] = {}

    def release(self, i: int) -> None:
        self.gates[i].set()

    async def one(self, r, write):
        i = r["index"]
        self.log.append(("start", i))
        self.started.setdefault(i, asyncio.Event()).set()
        if i in self.gates:
            await self.gates[i].wait()
        else:
            await asyncio.sleep(0)
        self.log.append(("end", i))
        write([i])

    async def wait_started(self, i: int) -> None:
        await self.started.setdefault(i, asyncio.Event()).wait()


def _count(log, kind, indexes):
    return sum(1 for k, i in log if k == kind and i in indexes)


def test_background_streams_stop_once_the_foreground_is_done():
    bg = set(range(100))
    d = _GatedDriver(hold=(100, 101))
    reqs = [runner._wire(Request(i, [1], 1, i, stream=0, background=True)) for i in range(100)]
    reqs.append(runner._wire(Request(100, [1], 1, 100, at=0.05)))
    reqs.append(runner._wire(Request(101, [1], 1, 101, at=0.05, stream=1)))
    reqs.append(runner._wire(Request(102, [1], 1, 102, at=0.05, stream=1)))
    rows: list = []

    async def go():
        t0 = time.time()
        run = asyncio.ensure_future(runner._scheduled(d, reqs, t0, rows.append))
        await d.wait_started(100)
        await d.wait_started(101)
        sent_at = time.time()
        assert ("start", 102) not in d.log  # one after another: 102 waits for 101
        d.release(101)
        await d.wait_started(102)
        ran = _count(d.log, "end", bg)
        d.release(100)
        await run
        return t0, sent_at, ran

    t0, sent_at, ran_alongside = asyncio.run(asyncio.wait_for(go(), 60))  # a hang guard only
    assert {100, 101, 102} <= {r[0] for r in rows}
    assert sent_at - t0 >= 0.05  # not before its time
    assert ran_alongside >= 1  # the flood ran alongside the foreground
    last_fg = max(k for k, (kind, i) in enumerate(d.log) if kind == "end" and i in (100, 101, 102))
    assert not any(kind == "start" and i in bg for kind, i in d.log[last_fg:])  # then stopped


def test_a_background_stream_starts_over_until_the_foreground_is_done():
    """However fast the server, a stream that runs out of requests before the foreground is done starts
    over from its first one, so what it is measured against never runs without it."""
    d = _GatedDriver(hold=(3,))
    reqs = [runner._wire(Request(i, [1], 1, i, stream=0, background=True)) for i in range(3)]
    reqs.append(runner._wire(Request(3, [1], 1, 3)))

    async def go():
        run = asyncio.ensure_future(runner._scheduled(d, reqs, time.time(), lambda row: None))
        while _count(d.log, "end", {0, 1, 2}) < 7:  # past the stream's three requests, twice over
            await asyncio.sleep(0)
        d.release(3)
        await run

    asyncio.run(asyncio.wait_for(go(), 60))  # a hang guard only
    starts = [i for kind, i in d.log if kind == "start" and i != 3]
    assert starts[:7] == [0, 1, 2, 0, 1, 2, 0]
    end_fg = d.log.index(("end", 3))
    assert not any(kind == "start" for kind, _ in d.log[end_fg:])


def test_background_streams_without_a_foreground_run_once():
    d = _GatedDriver()
    reqs = [runner._wire(Request(i, [1], 1, i, stream=i % 2, background=True)) for i in range(6)]
    asyncio.run(runner._scheduled(d, reqs, time.time(), lambda row: None))
    assert sorted(i for kind, i in d.log if kind == "start") == list(range(6))


def test_an_after_streams_request_waits_for_every_background_stream_to_finish_one():
    d = _GatedDriver(hold=(0, 1))
    reqs = [runner._wire(Request(i, [1], 1, i, stream=i, background=True)) for i in range(2)]
    reqs.append(runner._wire(Request(2, [1], 1, 2, after_streams=True)))

    async def go():
        run = asyncio.ensure_future(runner._scheduled(d, reqs, time.time(), lambda row: None))
        await d.wait_started(0)
        await d.wait_started(1)
        d.release(0)
        while ("end", 0) not in d.log:
            await asyncio.sleep(0)
        for _ in range(20):  # stream 1 is still on its first request: the long one must not go
            await asyncio.sleep(0)
        assert ("start", 2) not in d.log
        d.release(1)
        await d.wait_started(2)
        await run

    asyncio.run(asyncio.wait_for(go(), 60))  # a hang guard only
    assert d.log.index(("start", 2)) > d.log.index(("end", 1))
