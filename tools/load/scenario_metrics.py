"""What a scenario measures, from the client's records (and the server's count of tokens it generated).

Pure functions of `runner.Record`s and the scenario's requests (their
`role`), so that each figure is unit-tested on hand-made traces and computed
the same way for every server. Latencies in ms, rates per second of the
run's own window (first request sent to last token).
"""

from __future__ import annotations

from collections.abc import Sequence

from tools.load.report import Slo, pct
from tools.load.runner import Record
from tools.load.workload import Request


def roles(requests: Sequence[Request]) -> dict[int, str]:
    return {r.index: r.role for r in requests}


def _window(records: Sequence[Record]) -> float:
    begin = min((r.sent for r in records), default=0.0)
    end = max(((r.last or r.sent) for r in records), default=0.0)
    return max(end - begin, 1e-9)


def _tokens_per_s(records: Sequence[Record]) -> float:
    ok = [r for r in records if r.error is None]
    return round(sum(r.tokens for r in ok) / _window(records), 1) if records else 0.0


def stream_gaps(times: Sequence[Sequence[float]], t0: float, t1: float) -> tuple[list[float], list[float]]:
    """Gaps (ms) between consecutive token events of each stream (`times[k]`: one stream's instants, in
    order): those overlapping [t0, t1], and those wholly outside it."""
    inside: list[float] = []
    outside: list[float] = []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            (inside if b > t0 and a < t1 else outside).append(round((b - a) * 1000.0, 3))
    return inside, outside


def stream_times(records: Sequence[Record], requests: Sequence[Request], role: str = "stream") -> list[list[float]]:
    """Per stream (`Request.stream`) of `role`, the token instants of its requests one after another: a
    stream's back-to-back requests are one client's output, and the wait for a new request's first token
    stalls it like any other gap."""
    by_index = {r.index: r for r in requests}
    streams: dict[int, list[Record]] = {}
    for r in records:
        req = by_index.get(r.index)
        if req is not None and req.role == role and r.error is None:
            streams.setdefault(req.stream if req.stream is not None else -1 - r.index, []).append(r)
    return [[t for r in sorted(rs, key=lambda x: x.sent) for t in r.token_times()] for _, rs in sorted(streams.items())]


def long_prompt(records: Sequence[Record], requests: Sequence[Request]) -> dict:
    """Streams decoding while long prompts arrive: the streams' gaps during the long prefills (from the
    first long prompt sent to the last one's first token), outside them, and the long prompts' TTFT.

    A stream's gaps run across its back-to-back requests (`stream_times`): a server that keeps a stream's
    next request waiting behind a long prefill stalls that stream as surely as one that skips its decode
    steps."""
    role = roles(requests)
    streams = [r for r in records if role.get(r.index) == "stream" and r.error is None]
    longs = [r for r in records if role.get(r.index) == "long"]
    out: dict = {"requests": len(records), "errors": sum(r.error is not None for r in records)}
    if not longs:
        return out
    t0 = min(r.sent for r in longs)
    firsts = [r.first for r in longs if r.first is not None]
    t1 = max(firsts) if len(firsts) == len(longs) else max((r.last or r.sent) for r in records)
    times = [ts for ts in stream_times(records, requests) if ts]
    inside, outside = stream_gaps(times, t0, t1)
    ttft = [r.ttft_ms for r in longs if r.ttft_ms is not None]
    # every stream's output must span the window, or its worst gap says nothing
    covered = bool(times) and all(ts[0] <= t0 and ts[-1] >= t1 for ts in times)
    out.update(window_ms=round((t1 - t0) * 1000.0, 1), streams_cover_window=covered,
               worst_gap_ms=max(inside) if inside else None, gap_p99_in_window_ms=pct(inside, 0.99),
               gap_p50_in_window_ms=pct(inside, 0.5), gap_p50_outside_ms=pct(outside, 0.5),
               long_ttft_max_ms=round(max(ttft), 3) if ttft else None, long_ttft_p50_ms=pct(ttft, 0.5),
               stream_tokens_per_s=_tokens_per_s(streams))
    return out


def tenant_flood(records: Sequence[Record], requests: Sequence[Request], flood: str = "a", few: str = "b") -> dict:
    """Tenant `flood` keeps many requests outstanding, `few` sends one after another: `few`'s TTFT and
    the flood's throughput (over its own window)."""
    a = [r for r in records if r.tenant == flood]
    b = [r for r in records if r.tenant == few]
    ttft_b = [r.ttft_ms for r in b if r.error is None and r.ttft_ms is not None]
    ttft_a = [r.ttft_ms for r in a if r.error is None and r.ttft_ms is not None]
    return {"requests": len(records), "errors": sum(r.error is not None for r in records),
            "b_requests": len(b), "b_ttft_p50_ms": pct(ttft_b, 0.5), "b_ttft_p99_ms": pct(ttft_b, 0.99),
            "a_ttft_p50_ms": pct(ttft_a, 0.5), "a_tokens_per_s": _tokens_per_s(a),
            "b_ttft_ms": sorted(round(x, 1) for x in ttft_b), "a_ttft_ms": sorted(round(x, 1) for x in ttft_a)}


def burst(records: Sequence[Record], slo: Slo) -> dict:
    """Open-loop arrivals with bursts: goodput (requests meeting `slo` per second of the window), SLO
    misses among the finished requests, 429s (pushed back) and other failures counted apart."""
    window = _window(records)
    good = [r for r in records if slo.met(r)]
    finished = [r for r in records if r.error is None]
    ttft = [r.ttft_ms for r in finished if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in finished if r.tpot_ms is not None]
    return {"requests": len(records), "slo": str(slo), "slo_met": len(good),
            "slo_missed": len(finished) - len(good), "rejected_429": sum(r.error == 429 for r in records),
            "errors": sum(r.error is not None for r in records),
            "other_errors": sum(r.error is not None and r.error != 429 for r in records),
            "goodput_requests_per_s": round(len(good) / window, 3),
            "goodput_tokens_per_s": round(sum(r.tokens for r in good) / window, 1),
            "tokens_per_s": _tokens_per_s(records), "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "tpot_p50_ms": pct(tpot, 0.5), "tpot_p99_ms": pct(tpot, 0.99), "seconds": round(window, 3)}


def hangups(records: Sequence[Record], server_generated: int | None) -> dict:
    """Clients hanging up mid-stream: the tokens the server generated that no client received (after a
    disconnect, or on its way when the client left) per disconnect, and the others' TPOT.

    `server_generated`: the server's count of tokens generated during the run (None: it has none).
    The client's count is exact over ZeroMQ and with `usage`; for a stream cut short over HTTP it is its
    content events, so a server that coalesces tokens into events is charged a little too much.
    """
    gone = [r for r in records if r.disconnected]
    others = [r for r in records if not r.disconnected and r.error is None]
    delivered = sum(r.tokens for r in records if r.error is None or r.disconnected)
    tpot = [r.tpot_ms for r in others if r.tpot_ms is not None]
    wasted = None if server_generated is None else max(0, server_generated - delivered)
    return {"requests": len(records), "errors": sum(r.error is not None for r in records),
            "disconnects": len(gone), "delivered_tokens": delivered, "server_generated_tokens": server_generated,
            "wasted_tokens": wasted,
            "wasted_per_disconnect": None if wasted is None or not gone else round(wasted / len(gone), 2),
            "others_tpot_p50_ms": pct(tpot, 0.5), "others_tpot_p99_ms": pct(tpot, 0.99),
            "others_tokens_per_s": _tokens_per_s(others)}
