"""Hostile and broken clients: a flood of malformed and oversized messages, a client that stops
reading its streams, clients that vanish mid-stream.

The daemon must answer every malformed message with one 400 and keep serving
the well-behaved clients beside it; it must cut off a client that does not
read (cancelling its requests) without stalling anyone else; and it must
notice vanished clients and free their lanes.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time

import orjson

from tools.chaos.harness import (SLOW_SIM, DaemonUnderTest, ScenarioResult, check_traces, health,
                                 serves_fresh_requests, stream_all, wait_until)
from tools.load.local_daemon import stats
from tools.load.wire_load import WireLoad

MAX_MESSAGE_BYTES = 4096


def _malformed(i: int) -> tuple[bytes, str | None, str]:
    """(frame, the id the daemon can read from it or None, the 400 reason it must get)."""
    rid = f"bad{i}"
    kinds = [
        (b"\xff\xfe{not json", None, "bad_json"),
        (b"[1, 2, 3]", None, "not_an_object"),
        (orjson.dumps({"v": 1, "op": "generate", "id": rid, "prompt": "abc"}), rid, "bad_type"),
        (orjson.dumps({"v": 1, "op": "launch", "id": rid}), rid, "unknown_op"),
        (orjson.dumps({"v": 2, "op": "health", "id": rid}), rid, "bad_version"),
        (orjson.dumps({"v": 1, "op": "generate", "id": rid, "prompt": [1], "max_token": 3}), rid, "unknown_field"),
        (orjson.dumps({"v": 1, "op": "generate", "id": rid, "prompt": [-1]}), rid, "out_of_range"),
        (orjson.dumps({"v": 1, "op": "generate", "id": rid, "prompt": [7] * 3000}), rid, "too_large"),
        (orjson.dumps({"v": 1, "op": "generate", "id": rid}), rid, "missing_field"),
    ]
    return kinds[i % len(kinds)]


def malformed_flood(res: ScenarioResult) -> None:
    """900 malformed and oversized frames from one client while another streams normally."""
    n_bad, n_good = 900, 30
    with DaemonUnderTest(res, backend="stub", chips=1,
                         settings=[f"server.max_message_bytes={MAX_MESSAGE_BYTES}"]) as d:
        before = stats(d.endpoint)["frontend"]

        async def run():
            good, bad = WireLoad(d.endpoint), WireLoad(d.endpoint)
            try:
                await bad.call("health")  # connected and receiving
                frames = [_malformed(i) for i in range(n_bad)]
                good_task = asyncio.ensure_future(stream_all(good, n_good, 64))
                for f, _, _ in frames:
                    await bad.send_raw(f)
                # A frame beyond 16 x max_message_bytes: libzmq drops that connection (memory guard).
                giant = WireLoad(d.endpoint)
                await giant.send_raw(b"x" * (MAX_MESSAGE_BYTES * 17))
                traces = await good_task
                t0 = time.monotonic()
                while len(bad.unknown_events) < n_bad and time.monotonic() - t0 < 30:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                await giant.close()
                return traces, frames, list(bad.unknown_events), bad.undecodable
            finally:
                await good.close()
                await bad.close()

        traces, frames, replies, undecodable = asyncio.run(run())
        res.faults, res.requests = n_bad + 1, n_good
        check_traces(res, traces, allowed_errors=set())
        res.expect(undecodable == 0, f"{undecodable} replies were not valid events")
        res.expect(len(replies) == n_bad, f"{len(replies)} replies to {n_bad} malformed frames (want one each)")
        res.expect(all(e.get("ev") == "error" and e.get("code") == 400 for e in replies),
                   "a malformed frame got something other than a 400 error")
        by_id = {}
        for e in replies:
            by_id.setdefault(e.get("id"), []).append(e)
        for f, rid, reason in frames:
            if rid is not None:
                got = by_id.get(rid, [])
                if len(got) != 1 or got[0].get("reason") != reason:
                    res.fail(f"frame for {rid}: want one 400 {reason}, got {[g.get('reason') for g in got]}")
                    break
        reasons: dict[str, int] = {}
        for e in replies:
            reasons[e.get("reason")] = reasons.get(e.get("reason"), 0) + 1
        after = stats(d.endpoint)["frontend"]
        res.details.update(reasons=reasons, protocol_errors=after["protocol_errors"] - before["protocol_errors"])
        res.expect(after["protocol_errors"] - before["protocol_errors"] == n_bad,
                   "frontend.protocol_errors did not count every malformed frame")
        h = health(d.endpoint)
        res.expect(bool(h and h["ok"]), "the daemon is not healthy after the flood")
        serves_fresh_requests(res, d.endpoint)
        res.recovery_s = 0.0


def slow_reader(res: ScenarioResult) -> None:
    """A client opens 120 long streams and never reads them; another client must not notice."""
    with DaemonUnderTest(res, backend="stub", chips=1, settings=["server.max_send_queue=16"]) as d:
        before = stats(d.endpoint)

        async def run():
            bad = WireLoad(d.endpoint, rcvhwm=1, rcvbuf=2048)
            good = WireLoad(d.endpoint)
            try:
                bad.reading = False
                t0 = time.monotonic()
                # More output than the pipes and socket buffers between the two can absorb before the
                # streams end (about 480k tokens, > CLIENT_STALL_S of the stub's output), whatever the speed.
                for i in range(120):
                    await bad.start([5, 6, i % 200], max_tokens=4000, seed=i, ignore_eos=True)
                good_traces = await stream_all(good, 30, 64, timeout=60)
                # The daemon must drop the stalled client and cancel its requests.
                dropped, _ = await asyncio.to_thread(wait_until, lambda: (stats(d.endpoint)["frontend"]["dropped_clients"]
                                                                   > before["frontend"]["dropped_clients"]), 30)
                idle, _ = await asyncio.to_thread(wait_until, lambda: (health(d.endpoint) or {}).get("active_requests") == 0, 30)
                recovered = time.monotonic() - t0
                bad.reading = True  # whatever the daemon had queued for it arrives now
                await asyncio.sleep(1.0)
                return good_traces, list(bad.traces.values()), dropped, idle, recovered
            finally:
                await good.close()
                await bad.close()

        good_traces, bad_traces, dropped, idle, recovered = asyncio.run(run())
        res.faults, res.requests = 1, len(good_traces) + len(bad_traces)
        check_traces(res, good_traces, allowed_errors=set())
        res.expect(bool(dropped), "the daemon never dropped the client that stopped reading")
        res.expect(bool(idle), "the stalled client's requests were never cancelled (active_requests > 0)")
        res.recovery_s = recovered if dropped and idle else None
        dup = [t.rid for t in bad_traces if len(t.terminals) > 1 or t.after_terminal]
        res.expect(not dup, f"stalled client's requests with events after their terminal event: {dup[:3]}")
        ttft = sorted(t.ttft_ms for t in good_traces if t.ttft_ms is not None)
        after = stats(d.endpoint)
        res.details.update(good_ttft_p99_ms=ttft[int(len(ttft) * 0.99) - 1] if ttft else None,
                           blocked_clients=after["frontend"]["blocked_clients"] - before["frontend"]["blocked_clients"],
                           dropped_events=after["frontend"]["dropped_events"] - before["frontend"]["dropped_events"],
                           stalled_client_terminal_events=sum(1 for t in bad_traces if t.terminals))
        serves_fresh_requests(res, d.endpoint)


def _vanishing_client(endpoint: str, n: int) -> int:
    """Child process: start `n` long streams, say `ready` once each has a token, then wait to be killed."""

    async def run():
        load = WireLoad(endpoint)
        traces = [await load.start([9, 8, i], max_tokens=1500, seed=i, ignore_eos=True) for i in range(n)]
        while any(t.first is None and not t.terminals for t in traces):
            await asyncio.sleep(0.01)
        ended = [t.terminal for t in traces if t.terminals]
        sys.stdout.write("ready\n" if not ended else f"ended early: {ended[0]}\n")
        sys.stdout.flush()
        await asyncio.sleep(3600)

    asyncio.run(run())
    return 0


def vanishing_clients(endpoint: str, clients: int = 3, streams: int = 10, on_ready=None) -> str | None:
    """`clients` processes start `streams` long streams each; once every one streams, `on_ready()` runs and
    they are all killed (-9). Returns why they could not be got going (None when they were, and died)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen([sys.executable, "-m", "tools.chaos.client_faults", "vanish", endpoint, str(streams)],
                              stdout=subprocess.PIPE, cwd=root) for _ in range(clients)]
    try:
        for p in procs:
            ready, _, _ = select.select([p.stdout], [], [], 60)
            line = p.stdout.readline() if ready else b""
            if line.strip() != b"ready":
                return f"a vanishing client did not get its streams going within 60 s: {line[:300]!r}"
        if on_ready is not None:
            on_ready()
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()


def clients_vanish(res: ScenarioResult) -> None:
    """Three client processes with 10 streams each are killed (-9) mid-stream."""
    with DaemonUnderTest(res, backend="sim", chips=1, backend_options=SLOW_SIM) as d:
        before = stats(d.endpoint)["daemon"]
        seen = {}
        why = vanishing_clients(d.endpoint, 3, 10,
                                on_ready=lambda: seen.update(active=(health(d.endpoint) or {}).get("active_requests")))
        if why is not None:
            res.fail(why)
            return
        active = seen["active"]
        res.details["active_before_kill"] = active
        idle, waited = wait_until(lambda: (health(d.endpoint) or {}).get("active_requests") == 0, 30)
        res.faults, res.requests = 3, 30
        res.recovery_s = waited if idle else None
        res.expect(active == 30, f"{active} requests active before the kill, want 30")
        res.expect(bool(idle), "the vanished clients' requests were never cancelled")
        after = stats(d.endpoint)["daemon"]
        res.details["cancelled_dead_clients"] = after["cancelled_dead_clients"] - before["cancelled_dead_clients"]
        res.expect(res.details["cancelled_dead_clients"] == 30, "the daemon did not cancel exactly the 30 orphans")

        async def good():
            load = WireLoad(d.endpoint)
            try:
                return await stream_all(load, 20, 16, timeout=60)
            finally:
                await load.close()

        check_traces(res, asyncio.run(good()), allowed_errors=set())
        res.requests += 20
        serves_fresh_requests(res, d.endpoint)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "vanish":
    sys.exit(_vanishing_client(sys.argv[2], int(sys.argv[3])))
