"""`npuserve bench micro http-client`: what a streamed SSE event costs the load client, aiohttp against httpx.

Why `npuserve bench --openai` uses aiohttp: at 64 streams on 2 cores the
client must not be the bottleneck. A minimal asyncio server in a process of
its own streams OpenAI-shaped completion chunks (one chunk per event,
`--events` per request) as fast as it can; the same client loop (64 streams,
closed loop, the project's SSE decoder, one JSON parse per event) runs once
through each library, alternating, and the client process's CPU time per
event is the figure. httpx is not a dependency: without it that column is
left out (`pip install httpx` to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import orjson

from tools.bench.options import add
from tools.load.paired import alternate
from tools.load.report import publish

EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
         b'"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
BODY = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 256, "stream": True})


def _chunk(b: bytes) -> bytes:
    return b"%x\r\n" % len(b) + b + b"\r\n"


async def _serve(port_out, events: int) -> None:
    tail = _chunk(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % events) + b"0\r\n\r\n"

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = next((int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")), 0)
                await r.readexactly(n)
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for _ in range(events):
                    w.write(_chunk(EVENT))
                    await w.drain()
                    await asyncio.sleep(0)
                w.write(tail)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port_out.write(f"{server.sockets[0].getsockname()[1]}\n")
    port_out.flush()
    async with server:
        await server.serve_forever()


async def _client(lib: str, url: str, streams: int, requests: int) -> int:
    from tools.load.sse import SseDecoder

    n = 0

    def consume(dec: SseDecoder, data: bytes) -> None:
        nonlocal n
        for ev in dec.feed(data):
            if ev.data != b"[DONE]":
                orjson.loads(ev.data)
                n += 1

    if lib == "aiohttp":
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one() -> None:
                async with s.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                    dec = SseDecoder()
                    async for data in r.content.iter_any():
                        consume(dec, data)
            await _slots(one, streams, requests)
    else:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=60) as s:
            async def one() -> None:
                async with s.stream("POST", url, content=BODY, headers={"content-type": "application/json"}) as r:
                    dec = SseDecoder()
                    async for data in r.aiter_raw():
                        consume(dec, data)
            await _slots(one, streams, requests)
    return n


async def _slots(one, streams: int, requests: int) -> None:
    async def slot(k: int) -> None:
        for _ in range(k):
            await one()
    await asyncio.gather(*(slot(requests // streams) for _ in range(streams)))


def _measure(lib: str, url: str, streams: int, requests: int) -> dict:
    t, c = time.perf_counter(), time.process_time()
    n = asyncio.run(_client(lib, url, streams, requests))
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return {"client": lib, "events": n, "seconds": round(wall, 3), "events_per_s": round(n / wall),
            "cpu_us_per_event": round(1e6 * cpu / n, 2)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve bench micro http-client", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--events", type=int, default=256, help="SSE events per request")
    add(ap, "json", rounds=3)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        asyncio.run(_serve(sys.stdout, a.events))
        return 0
    libs = ["aiohttp"]
    try:
        import httpx  # noqa: F401

        libs.append("httpx")
    except ImportError:
        print("httpx is not installed: aiohttp alone (pip install httpx to compare)", file=sys.stderr)
    server = subprocess.Popen([sys.executable, "-m", "tools.bench.micro.http_client", "--serve", "--events", str(a.events)],
                              stdout=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{int(server.stdout.readline())}/v1/completions"
        rows = alternate(libs, a.rounds, lambda lib, r, _g: dict(_measure(lib, url, a.streams, a.requests), round=r + 1))
    finally:
        server.terminate()
        server.wait()
    med = {lib: statistics.median(r["cpu_us_per_event"] for r in rows if r["client"] == lib) for lib in libs}
    summary = {"cpu_us_per_event": med,
               "httpx_over_aiohttp": round(med["httpx"] / med["aiohttp"], 2) if "httpx" in med else None}
    publish("bench-http-client", a.json, [*(("row", r) for r in rows), ("summary", summary)], lambda: "\n".join([
        f"{a.streams} streams, {a.requests} requests of {a.events} events each, per round",
        f"{'client':<8} {'round':>5} {'events/s':>10} {'cpu µs/event':>13}",
        *(f"{r['client']:<8} {r['round']:>5} {r['events_per_s']:>10,} {r['cpu_us_per_event']:>13.2f}" for r in rows),
        "medians: " + ", ".join(f"{k} {v:.2f} µs/event" for k, v in med.items())
        + (f"; httpx / aiohttp = {summary['httpx_over_aiohttp']}x" if summary["httpx_over_aiohttp"] else "")]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
