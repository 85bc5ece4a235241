"""Driving a workload from several client processes: through `AsyncClient`, or over HTTP (`openai_load`).

Several processes, so the client is not the bottleneck; they connect first and
start on a shared wall-clock instant (the measurement window starts like the
simulator's t = 0). Closed loop: each process keeps its share of
`concurrency` requests outstanding. Open loop: each request is sent at its
arrival time (`Request.at`), however many are outstanding. Each process
writes one JSON line per finished request as it finishes, which the parent
folds into the live progress bar and the records.
"""

from __future__ import annotations

import asyncio
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import orjson

from tools.load.workload import Request


class Timed:
    """TTFT and TPOT of a request from its `sent`, `first` and `last` instants (seconds) and `token_count`:
    what `Record` and the wire client's `Trace` both report."""

    __slots__ = ()

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first is None else (self.first - self.sent) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        n = self.token_count
        return None if n < 2 or self.first is None else (self.last - self.first) * 1000.0 / (n - 1)


@dataclass(slots=True)
class Record(Timed):
    """One request as the client saw it (wall-clock seconds)."""

    index: int
    tenant: str
    sent: float
    first: float | None
    last: float | None
    tokens: int
    error: int | None  # the error code, None when it finished
    itl_ms: list[float] | None = None  # gaps between the stream's token events (one event may carry several)
    disconnected: bool = False  # the client hung up on purpose (`Request.disconnect_after`), not an error

    def token_times(self) -> list[float]:
        """The instants (s) of the stream's token events: the first, then each gap after it."""
        if self.first is None:
            return []
        out = [self.first]
        for g in self.itl_ms or ():
            out.append(out[-1] + g / 1000.0)
        return out

    @property
    def token_count(self) -> int:
        return self.tokens


# ---------------------------------------------------------------- client process


class _ZmqDriver:
    """The client library over ZeroMQ (`AsyncClient`); `openai_load.OpenAIDriver` is the HTTP one.

    One client per endpoint; with several (a load split over daemons), the process's requests take them in
    turn, in the order they are sent.
    """

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.sent = 0

    async def __aenter__(self) -> "_ZmqDriver":
        from engine.async_client import AsyncClient

        self.cs = [await AsyncClient(e, timeout=self.spec.get("timeout", 600),
                                     batched_events=self.spec.get("batched_events", True)).__aenter__()
                   for e in self.spec["endpoints"]]
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.cs:
            await c.__aexit__(*exc)

    async def ready(self, streams: int = 1) -> None:
        for c in self.cs:
            await c.health()  # connected before the clock starts (one DEALER carries every stream)

    async def one(self, r: dict, write) -> None:
        from engine.client import build_generate
        from engine.errors import ClientError

        c = self.cs[self.sent % len(self.cs)]
        self.sent += 1
        t0 = time.time()
        first = last = None
        n = 0
        err = None
        gaps: list[float] = []
        hang_up = r.get("disconnect_after")
        chunks = None
        try:
            if r.get("text") is not None:
                rid = c.new_id()
                msg = build_generate(rid, [0], True, r["fields"])
                del msg["prompt"]
                msg["text"] = r["text"]
                chunks = c.stream_message(msg)
            else:
                chunks = c.stream(r["prompt"], **r["fields"])
            async for chunk in chunks:
                now = time.time()
                if first is None:
                    first = now
                else:
                    gaps.append(round((now - last) * 1000.0, 3))
                last = now
                n += len(chunk)
                if hang_up is not None and n >= hang_up:
                    break
        except ClientError as e:
            err = e.code or 0
        finally:
            if chunks is not None:
                await chunks.aclose()  # leaving early: the client library cancels the request
        write([r["index"], r["tenant"], t0, first, last, n, err, gaps, hang_up is not None and err is None
               and n >= hang_up])


async def _drive(spec: dict, write: Callable[[list], None] | None = None) -> None:
    """Send `spec["requests"]`, each finished one as a row to `write` (default: a JSON line on stdout)."""
    if write is None:
        out = sys.stdout.buffer

        def write(row: list) -> None:
            out.write(orjson.dumps(row) + b"\n")
            out.flush()

    if spec.get("openai"):
        from tools.load.openai_load import OpenAIDriver as Driver
    else:
        Driver = _ZmqDriver
    reqs = spec["requests"]
    async with Driver(spec) as d:
        scheduled = any(r.get("stream") is not None for r in reqs)
        # Connections opened before the clock: one per stream closed loop; an open loop's guess at what is
        # outstanding; a scenario's (seconds-long events) just one, the rest opened when first needed,
        # since an idle kept-alive connection holds one of llama.cpp's HTTP threads.
        await d.ready(1 if scheduled else min(len(reqs), spec["concurrency"] or 64))
        start = spec["start_at"] or time.time()  # None: as soon as this one client is connected
        await asyncio.sleep(max(0.0, start - time.time()))
        if scheduled:  # a scenario: per-stream closed loops, scheduled
            await _scheduled(d, reqs, start, write)
        elif spec["concurrency"]:  # closed loop
            it = iter(reqs)

            async def slot() -> None:
                for r in it:
                    await d.one(r, write)

            await asyncio.gather(*(slot() for _ in range(spec["concurrency"])))
        else:  # open loop
            tasks = []
            for r in reqs:
                await asyncio.sleep(max(0.0, start + r["at"] - time.time()))
                tasks.append(asyncio.create_task(d.one(r, write)))
            await asyncio.gather(*tasks)


async def _scheduled(d, reqs: list[dict], start: float, write) -> None:
    """A scenario's requests: those of one `stream` one after another, each no sooner than `start + at`;
    those without a stream at their `at`. A `background` stream starts no new request once every
    foreground request has finished (a flood that lasts exactly as long as what it is measured against)."""
    streams: dict[int, list[dict]] = {}
    loose = []
    for r in reqs:
        (streams.setdefault(r["stream"], []) if r.get("stream") is not None else loose).append(r)
    foreground = [r for r in reqs if not r.get("background")]
    left = [len(foreground)]

    async def one(r: dict) -> None:
        await asyncio.sleep(max(0.0, start + r.get("at", 0.0) - time.time()))
        await d.one(r, write)
        if not r.get("background"):
            left[0] -= 1

    async def stream(rs: list[dict]) -> None:
        for r in rs:
            if r.get("background") and foreground and left[0] <= 0:
                return
            await one(r)

    await asyncio.gather(*(stream(rs) for rs in streams.values()), *(one(r) for r in loose))


def run_loop(coro):
    """Run a client process's coroutine on uvloop (installed with uvicorn[standard]), else asyncio's loop.

    The same loop for both routes, and the faster one: asyncio's own loop
    costs the HTTP client ~0.3 ms of its own per response (read to response
    object) and a request's send one slow loop turn, which the front's
    added TTFT would be charged with (docs/benchmarks.md, bench-http).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def client_main() -> int:
    run_loop(_drive(orjson.loads(sys.stdin.buffer.read())))
    return 0


# ---------------------------------------------------------------- parent


def _wire(r: Request) -> dict:
    d = {"index": r.index, "tenant": r.tenant, "prompt": r.prompt, "text": r.text, "fields": r.wire(),
         "at": r.at}
    if r.stream is not None:
        d.update(stream=r.stream, background=r.background)
    if r.disconnect_after is not None:
        d["disconnect_after"] = r.disconnect_after
    return d


def _shares(requests: list[Request], k: int) -> list[list[Request]]:
    """Each client process's requests: every k-th one, or whole streams (a scenario) so that a stream's
    requests stay in order in one process -- and a background stream with the foreground requests it
    waits for, which then all go to one process."""
    if not any(r.stream is not None for r in requests):
        return [requests[i::k] for i in range(k)]
    if any(r.background for r in requests):
        return [requests] + [[] for _ in range(k - 1)]
    out: list[list[Request]] = [[] for _ in range(k)]
    for r in requests:
        out[(r.stream if r.stream is not None else r.index) % k].append(r)
    return out


def run_here(endpoint: str, requests: list[Request], *, concurrency: int | None,
             timeout: float = 600.0) -> list[Record]:
    """`run` with one client in this process and no start barrier: for a benchmark whose other side is driven
    in-process too (`bench-peer`), so neither pays for a client process the other does not have."""
    records: list[Record] = []
    spec = {"endpoints": [endpoint], "concurrency": concurrency, "start_at": None, "timeout": timeout,
            "requests": [_wire(r) for r in requests]}
    run_loop(_drive(spec, lambda row: records.append(Record(*row))))
    return records


def run(endpoint: str | list[str] | None, requests: list[Request], *, concurrency: int | None, clients: int = 2,
        on_record: Callable[[Record], None] | None = None, timeout: float = 600.0, openai: str | None = None,
        api_key: str | None = None, model: str | None = None, batched_events: bool = True) -> list[Record]:
    """Send `requests` (closed loop at `concurrency`, or open loop when it is None); one Record each.

    `batched_events=False`: the ZeroMQ clients do not ask for batched events (one event per message).

    Over ZeroMQ to `endpoint` (a list: each client process spreads its requests over all of them), or with `openai` (a server's base URL) over HTTP to an OpenAI-compatible
    server, `model` and `api_key` going into each request.
    """
    k = max(1, min(clients, concurrency or clients, len(requests)))
    start_at = time.time() + 1.0 + 0.2 * k
    procs = []
    shares = _shares(requests, k)
    for i in range(k):
        if not shares[i]:
            continue
        share = None
        if concurrency:
            share = concurrency // k + (1 if i < concurrency % k else 0)
        spec = {"endpoints": [endpoint] if isinstance(endpoint, str) else endpoint, "concurrency": share, "start_at": start_at, "timeout": timeout,
                "openai": openai, "api_key": api_key, "model": model, "batched_events": batched_events,
                "requests": [_wire(r) for r in shares[i]]}
        p = subprocess.Popen([sys.executable, "-m", "tools.load.runner"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
        p.stdin.write(orjson.dumps(spec))
        p.stdin.close()
        procs.append(p)
    records: list[Record] = []
    sel = selectors.DefaultSelector()
    buf: dict[int, bytes] = {}
    for p in procs:
        sel.register(p.stdout, selectors.EVENT_READ, p)
        buf[p.pid] = b""
    try:
        open_ = len(procs)
        while open_:
            for key, _ in sel.select(timeout=1.0):
                p = key.data
                chunk = p.stdout.read1(1 << 16)
                if not chunk:
                    sel.unregister(p.stdout)
                    open_ -= 1
                    continue
                data = buf[p.pid] + chunk
                *lines, buf[p.pid] = data.split(b"\n")
                for line in lines:
                    rec = Record(*orjson.loads(line))
                    records.append(rec)
                    if on_record is not None:
                        on_record(rec)
    finally:
        sel.close()
        for p in procs:
            if p.poll() is None and open_:
                p.kill()
            p.wait()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise SystemExit(f"a load client process failed (exit {bad[0]}); see its traceback above")
    return records


if __name__ == "__main__":
    sys.exit(client_main())
