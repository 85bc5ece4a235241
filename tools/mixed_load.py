"""A steady mixed load against a daemon, through the client library, to show memory leaks.

Why: the scheduler core alone under the simulator sees no cancels, deadlines
or non-streamed requests, so leaks in the shell show only under a real mix.
`Mix` holds the mix's parameters; `MixedLoad` keeps `mix.concurrency`
requests in flight over `mix.clients` client sockets and tallies how each
one ended, round after round, so a caller (this tool's `main`, the leak test
in tests/engine/daemon/test_daemon_memory.py) can sample the daemon between
rounds. Every request must end exactly once: an answer that never comes is
counted as `lost`. (`npuserve soak` has a mix of its own, `tools/soak/mix.py`,
over the raw wire client `tools/load/wire_load.py`, since it checks every
event and every token; `tools/soak/resources.py` samples memory its own way,
anonymous RSS through psutil, where this tool reads VmRSS and the ring pages
from /proc.)

    python -m tools.mixed_load --rounds 4 --round-s 60

starts a 2-chip `ref` daemon, runs the mix and prints the scheduler's and
each worker's RSS after every round (`--json`: one object per round).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import orjson

from engine.errors import ClientError, ClientTimeout
from tools.bench.options import add

_TEXT_VOCAB = 256  # byte-level ids: valid in every model package the project makes


@dataclass(frozen=True)
class Mix:
    """The parameters of the mix; the defaults are the mix of docs/benchmarks.md (memory under mixed load)."""

    concurrency: int = 32  # requests in flight at any time
    clients: int = 4  # client sockets they are spread over
    prompt_tokens: tuple[int, int] = (1, 1200)  # uniform, inclusive
    shared_prefix_share: float = 0.30  # prompts that start with the shared prefix
    shared_prefix_tokens: int = 64
    max_tokens: tuple[int, int] = (1, 96)  # uniform, inclusive
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    stream_share: float = 0.80
    cancel_share: float = 0.10  # cancelled at a random moment of their life
    cancel_within_s: float = 0.3  # the moment is uniform in [0, this)
    deadline_share: float = 0.05
    deadline_ms: tuple[int, int] = (5, 200)
    tenants: tuple[str, ...] = ("tenant-a", "tenant-b", "tenant-c")
    request_timeout_s: float = 120.0  # no terminal event within this: the request is counted lost
    seed: int = 0


@dataclass(frozen=True)
class MixedRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int
    tenant: str
    stream: bool
    deadline_ms: int | None
    cancel_after_s: float | None
    cancel_by_closing: bool  # a streamed cancel: leave the stream (the client cancels) vs send `cancel`


def draw(mix: Mix, rng: random.Random, prefix: list[int]) -> MixedRequest:
    """One request of the mix."""
    n = rng.randint(*mix.prompt_tokens)
    if rng.random() < mix.shared_prefix_share:
        n = max(n, len(prefix) + 1)
        prompt = prefix + [rng.randrange(_TEXT_VOCAB) for _ in range(n - len(prefix))]
    else:
        prompt = [rng.randrange(_TEXT_VOCAB) for _ in range(n)]
    stream = rng.random() < mix.stream_share
    cancel = rng.random() < mix.cancel_share
    deadline = rng.randint(*mix.deadline_ms) if rng.random() < mix.deadline_share else None
    return MixedRequest(
        prompt=prompt, max_tokens=rng.randint(*mix.max_tokens), temperature=rng.choice(mix.temperatures),
        seed=rng.randrange(1 << 31), tenant=rng.choice(mix.tenants), stream=stream, deadline_ms=deadline,
        cancel_after_s=rng.uniform(0, mix.cancel_within_s) if cancel else None,
        cancel_by_closing=cancel and stream and rng.random() < 0.5,
    )


@dataclass
class Tally:
    """How the requests of a run ended (`outcomes`: finish reason, or `error_<code>`, or `lost`)."""

    requests: int = 0
    tokens: int = 0
    outcomes: Counter = field(default_factory=Counter)

    @property
    def lost(self) -> int:
        return self.outcomes["lost"]

    def add(self, other: "Tally") -> None:
        self.requests += other.requests
        self.tokens += other.tokens
        self.outcomes.update(other.outcomes)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "tokens": self.tokens, "outcomes": dict(sorted(self.outcomes.items()))}


class MixedLoad:
    """`async with MixedLoad(endpoint, mix) as load: await load.run(requests=2000)`; clients stay open between runs."""

    def __init__(self, endpoint: str, mix: Mix = Mix()) -> None:
        self.endpoint = endpoint
        self.mix = mix
        self._rng = random.Random(mix.seed)
        self._prefix = [self._rng.randrange(_TEXT_VOCAB) for _ in range(mix.shared_prefix_tokens)]
        self._clients: list = []
        self.total = Tally()

    async def __aenter__(self) -> "MixedLoad":
        from engine.async_client import AsyncClient

        self._clients = [AsyncClient(self.endpoint, timeout=self.mix.request_timeout_s) for _ in range(self.mix.clients)]
        for c in self._clients:
            await c.health()  # connected before the load starts
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self._clients:
            await c.close()
        self._clients = []

    async def run(self, *, requests: int | None = None, duration_s: float | None = None) -> Tally:
        """Keep `mix.concurrency` requests in flight until `requests` were started or `duration_s` passed."""
        assert self._clients, "use MixedLoad as an async context manager"
        assert requests is not None or duration_s is not None
        tally = Tally()
        left = [requests if requests is not None else -1]
        end = None if duration_s is None else time.monotonic() + duration_s

        async def slot(i: int) -> None:
            client = self._clients[i % len(self._clients)]
            while left[0] != 0 and (end is None or time.monotonic() < end):
                left[0] -= 1
                req = draw(self.mix, self._rng, self._prefix)
                tally.requests += 1
                outcome, n = await self._one(client, req)
                tally.outcomes[outcome] += 1
                tally.tokens += n

        await asyncio.gather(*(slot(i) for i in range(self.mix.concurrency)))
        self.total.add(tally)
        return tally

    async def _one(self, client, req: MixedRequest) -> tuple[str, int]:
        """Run one request to its end; returns (outcome, tokens received)."""
        kw = dict(max_tokens=req.max_tokens, temperature=req.temperature, seed=req.seed, tenant=req.tenant,
                  deadline_ms=req.deadline_ms)
        rid = client.new_id()
        canceller = None
        if req.cancel_after_s is not None and not req.cancel_by_closing:
            canceller = asyncio.get_running_loop().call_later(
                req.cancel_after_s, lambda: asyncio.ensure_future(client.cancel(rid)))
        n = 0
        try:
            if not req.stream:
                res = await client.generate(req.prompt, id=rid, **kw)
                return res.finish_reason, len(res.tokens)
            sink: list = []
            t_close = None if not req.cancel_by_closing else time.monotonic() + req.cancel_after_s
            async with contextlib.aclosing(client.stream(req.prompt, id=rid, result=sink, **kw)) as chunks:
                async for chunk in chunks:
                    n += len(chunk)
                    if t_close is not None and time.monotonic() >= t_close:
                        return "closed", n  # closing the stream early: the client library sends the cancel
            return sink[0].finish_reason, n
        except ClientTimeout:
            return "lost", n
        except ClientError as e:
            return f"error_{e.code}", n
        finally:
            if canceller is not None:
                canceller.cancel()


# ---------------------------------------------------------------- the RSS table


_STATUS_FIELDS = ("VmRSS", "RssAnon", "RssShmem")


def process_memory(pid: int) -> dict[str, int]:
    """KiB of resident memory of one process: all (VmRSS), heap and other private memory (RssAnon), and
    shared-memory pages (RssShmem: the rings), from /proc/PID/status."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in _STATUS_FIELDS:
                out[key] = int(value.split()[0])
    return out


def daemon_memory(pid: int) -> dict[str, dict[str, int]]:
    """`process_memory` of the daemon's scheduler process `pid` and of each of its workers (by pid order)."""
    import psutil

    out = {"scheduler": process_memory(pid)}
    for i, child in enumerate(sorted(psutil.Process(pid).children(), key=lambda c: c.pid)):
        out[f"worker{i}"] = process_memory(child.pid)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench serve mixed-load", description=__doc__.split("\n\n")[0])
    add(p, rounds=4)
    p.add_argument("--round-s", type=float, default=60.0, help="seconds per round")
    p.add_argument("--warmup-s", type=float, default=20.0, help="load before the first measured round")
    p.add_argument("--chips", type=int, default=2)
    p.add_argument("--backend", default="ref")
    add(p, "set", "backend-option", "json", seed=0)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from tools.load import local_daemon

    a = parse_args(argv)
    d = local_daemon.start(backend=a.backend, chips=a.chips, settings=a.set, backend_options=a.backend_option,
                           prefix="npml-")
    try:
        local_daemon.wait_healthy(d.endpoint, d)
        lost = asyncio.run(_rounds(a, d.endpoint, d.pid))
    finally:
        d.cleanup()
    return 1 if lost else 0


async def _rounds(a: argparse.Namespace, endpoint: str, pid: int) -> int:
    mix = Mix(seed=a.seed)
    async with MixedLoad(endpoint, mix) as load:
        if a.warmup_s > 0:
            w = await load.run(duration_s=a.warmup_s)
            print(f"warm-up: {w.requests} requests", file=sys.stderr)
        mem = daemon_memory(pid)
        names = list(mem)
        if not a.json:
            print("RSS in MiB (of it: shared-memory rings)")
            print(f"{'round':>5} {'requests':>9} {'total':>7}  " + "  ".join(f"{n:>16}" for n in names) + "  outcomes")
            print(f"{0:>5} {'':>9} {load.total.requests:>7}  " + _mem_cells(mem, names))
        for i in range(1, a.rounds + 1):
            t = await load.run(duration_s=a.round_s)
            mem = daemon_memory(pid)
            row = {"round": i, "requests": t.requests, "total_requests": load.total.requests, "memory_kib": mem,
                   **t.as_dict(), "mix": asdict(mix)}
            if a.json:
                sys.stdout.buffer.write(orjson.dumps(row) + b"\n")
                sys.stdout.flush()
            else:
                print(f"{i:>5} {t.requests:>9} {load.total.requests:>7}  {_mem_cells(mem, names)}  "
                      f"{dict(sorted(t.outcomes.items()))}", flush=True)
        return load.total.lost


def _mem_cells(mem: dict, names: list[str]) -> str:
    cells = []
    for n in names:
        m = mem.get(n)
        cells.append(f"{'gone':>16}" if m is None else
                     f"{m['VmRSS'] / 1024:>8.1f} ({m['RssShmem'] / 1024:>4.1f})")
    return "  ".join(cells)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
