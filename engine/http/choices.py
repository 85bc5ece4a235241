"""`n` > 1 and `best_of` at the HTTP front: a request's choices upstream.

Each prompt's m choices (m = `best_of` or `n`) are one wire `generate` with `n`
= m (docs/protocol.md, "Several choices"): the board computes the prompt once
and a balancer keeps the choices on one board. An upstream older than the
field (400 `unknown_field` naming `n`; remembered per upstream client) gets m
sibling requests instead: choice 0 of each prompt (its leader) is sent at
once, its siblings when the leader's first event arrives, that is once the
board has computed the prompt, so their prompt's full KV blocks are the
board's prefix-cache hit. Either way each other choice recomputes the tokens
of the prompt's last partial block (`usage` and the board's
`prefix_hit_tokens` show it).

Seeds: choice k of a request with seed s samples with seed
(s + k * 0x9E3779B97F4A7C15) mod 2^64, so choice 0 is what n = 1 gives and the
choices are distinct, reproducible streams. `usage.prompt_tokens` counts each
prompt once; `completion_tokens` counts every choice generated (with `best_of`,
the ones not returned too, as OpenAI bills them). `best_of` returns the n
choices of highest cumulative logprob (not streamed). A client that hangs up
or a choice that fails ends every choice (the front cancels them upstream).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

MAX_CHOICES = 16
_GOLDEN = 0x9E3779B97F4A7C15


def choice_seed(seed: int, k: int) -> int:
    return (seed + k * _GOLDEN) & 0xFFFFFFFFFFFFFFFF


def expand(msgs: list[dict], m: int, score: bool) -> list[dict]:
    """Each prompt's message as m choices (prompt-major: choice c is prompt c // m), seeds derived; `score`:
    the upstream returns logprobs (best_of ranks by them)."""
    if m == 1:
        return msgs
    out = []
    for msg in msgs:
        for k in range(m):
            c = dict(msg, seed=choice_seed(int(msg.get("seed", 0)), k), stream=True)
            if score:
                c["logprobs"] = True
            out.append(c)
    return out


def _refuses_n(batch: list[dict]) -> bool:
    """The upstream does not know the wire field `n` (a server older than it)."""
    ev = batch[0]
    return ev.get("ev") == "error" and "index" not in ev and ev.get("reason") == "unknown_field" \
        and str(ev.get("message", "")).startswith("n:")


async def staggered_batches(client, msgs: list[dict], m: int) -> AsyncIterator[tuple[int, list[dict]]]:
    """(choice index, batch) of the choices' upstream streams. Each prompt's m choices are one upstream request
    with the wire field `n` (the board computes the prompt once and keeps them together); from an upstream that
    does not know `n` (remembered on the client), m sibling requests: the prompt's siblings start when its
    leader's first batch has come. m = 1: each message's stream, merged as they come. Closing it cancels them all."""
    q: asyncio.Queue = asyncio.Queue()
    started = [asyncio.Event() for _ in range(0, len(msgs), m)]

    async def pump(i: int, msg: dict) -> None:
        group = started[i // m]
        if i % m:
            await group.wait()
        try:
            async with contextlib.aclosing(client.stream_batches(msg)) as it:
                async for batch in it:
                    group.set()
                    q.put_nowait((i, batch))
        finally:
            group.set()  # a leader that failed: its siblings go on (and report what they get)

    async def wire(g: int) -> None:
        """Prompt g's choices as one upstream request with `n`; falls back to siblings when refused for it."""
        base = g * m
        if getattr(client, "wire_n", True) and hasattr(client, "choice_batches"):
            open_ = set(range(m))
            async with contextlib.aclosing(client.choice_batches(dict(msgs[base], n=m))) as it:
                async for batch in it:
                    if not open_ or (len(open_) == m and _refuses_n(batch)):
                        break
                    per: dict[int, list[dict]] = {}
                    for ev in batch:
                        ks = [ev["index"]] if "index" in ev else sorted(open_)  # no index: the whole request's
                        for k in ks:
                            e = {key: v for key, v in ev.items() if key != "index"}
                            per.setdefault(k, []).append(e)
                            if e.get("ev") in ("done", "error"):
                                open_.discard(k)
                    for k, evs in per.items():
                        q.put_nowait((base + k, evs))
                else:
                    return
            if open_ != set(range(m)):
                return
            client.wire_n = False
        await asyncio.gather(*(pump(base + k, msgs[base + k]) for k in range(m)))

    tasks = [asyncio.ensure_future(wire(g)) for g in range(len(started))] if m > 1 else \
        [asyncio.ensure_future(pump(i, msg)) for i, msg in enumerate(msgs)]
    try:
        left = len(msgs)
        while left:
            i, batch = await q.get()
            if batch[-1].get("ev") in ("done", "error"):
                left -= 1
            yield i, batch
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def fold(events: list[dict], into: dict | None) -> dict:
    """A streamed choice's events folded into one dict shaped as a non-streamed `done`."""
    d = into if into is not None else {"tokens": [], "logprobs": [], "text": ""}
    for ev in events:
        if ev.get("ev") == "tokens":
            d["tokens"] += ev.get("tokens") or []
            d["logprobs"] += ev.get("logprobs") or []
            d["text"] += ev.get("text") or ""
            if "top_logprobs" in ev:
                d.setdefault("top_logprobs", []).extend(ev["top_logprobs"])
            if "prompt_logprobs" in ev:
                d["prompt_logprobs"] = ev["prompt_logprobs"]
        else:
            d.update({k: v for k, v in ev.items() if k not in ("tokens", "logprobs", "text", "top_logprobs")})
    return d


def prompt_once(usage: dict, index: int, m: int) -> dict:
    """A choice's usage with its prompt counted only for the prompt's first choice."""
    if m == 1 or index % m == 0:
        return usage
    return {**usage, "prompt_tokens": 0, "cached_tokens": 0}


def best(dones: list[dict], m: int, n: int) -> list[int]:
    """For each prompt, the indices of its n choices of highest cumulative logprob (ties: the lower index)."""
    keep = []
    for g in range(0, len(dones), m):
        ranked = sorted(range(g, g + m), key=lambda i: (-sum(dones[i].get("logprobs") or ()), i))
        keep += sorted(ranked[:n])
    return keep


async def prompt_counted_once(batches: AsyncIterator[tuple[int, list[dict]]], m: int
                              ) -> AsyncIterator[tuple[int, list[dict]]]:
    """A stream's (index, batch) pairs with each sibling's `done.usage` counting no prompt tokens."""
    try:
        async for i, batch in batches:
            end = batch[-1]
            if i % m and end.get("ev") == "done" and "usage" in end:
                batch = batch[:-1] + [{**end, "usage": prompt_once(end["usage"], i, m)}]
            yield i, batch
    finally:
        await batches.aclose()
