"""Multi-turn conversations over OpenAI HTTP (`/v1/completions`, streamed), for any server: TTFT and prompt
tokens computed per request.

The same workload as `npuserve bench --conversations` (tools/bench/serve/conversations.py), but over HTTP so
that llama.cpp's own server can run it too: each turn's prompt is the whole conversation so far (token ids)
plus a new user message, turn by turn (every conversation's turn t, `concurrency` at a time, before any turn
t+1). The assistant's turn in the history is the workload's own tokens, not the generated text (token ids
do not come back over HTTP): both servers get byte-identical prompts, and both recompute those tokens.

Prompt tokens computed, per server: llama.cpp's final event carries `timings.prompt_n` (tokens it
evaluated; `timings.cache_n` were reused); npuserve's front (and llama.cpp's newer builds) report
`usage.prompt_tokens_details.cached_tokens`, computed = prompt - cached. `timings` wins when present.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import orjson

from tools.load.sse import SseDecoder


@dataclass(frozen=True)
class ConversationSpec:
    conversations: int
    turns: int
    first_len: int = 256
    turn_len: int = 32
    answer_len: int = 16
    vocab: int = 256
    seed: int = 42

    def max_len(self) -> int:
        """Tokens of the longest prompt plus its answer: what a server's context must hold."""
        return self.first_len + (self.turns - 1) * (self.answer_len + self.turn_len) + self.answer_len


def build(spec: ConversationSpec) -> list[list[list[int]]]:
    """Per conversation, per turn, the prompt (the whole history so far plus the new message)."""
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.conversations):
        history: list[int] = []
        prompts = []
        for t in range(spec.turns):
            if t:
                history += [rng.randrange(1, spec.vocab) for _ in range(spec.answer_len)]  # the assistant's turn
            history += [rng.randrange(1, spec.vocab) for _ in range(spec.first_len if t == 0 else spec.turn_len)]
            prompts.append(list(history))
        out.append(prompts)
    return out


def computed_tokens(final: dict, prompt_len: int) -> tuple[int | None, int | None]:
    """(prompt tokens computed, cached) from a stream's last events (`timings`, `usage`); None if unsaid."""
    t = final.get("timings")
    if isinstance(t, dict) and isinstance(t.get("prompt_n"), int):
        return t["prompt_n"], t.get("cache_n")
    u = final.get("usage")
    d = u.get("prompt_tokens_details") if isinstance(u, dict) else None
    if isinstance(d, dict) and isinstance(d.get("cached_tokens"), int):
        return prompt_len - d["cached_tokens"], d["cached_tokens"]
    return None, None


async def _one(session, url: str, model: str | None, prompt: list[int], answer_len: int) -> dict:
    body = {"prompt": prompt, "max_tokens": answer_len, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "ignore_eos": True}
    if model:
        body["model"] = model
    import aiohttp

    sent, first, final, error = time.monotonic(), None, {}, None
    try:
        async with session.post(url + "/v1/completions", data=orjson.dumps(body)) as resp:
            if resp.status != 200:
                error = resp.status
                await resp.read()
            else:
                dec = SseDecoder()
                async for chunk in resp.content.iter_any():
                    now = time.monotonic()
                    for ev in dec.feed(chunk):
                        if ev.data == b"[DONE]":
                            continue
                        obj = orjson.loads(ev.data)
                        if "error" in obj:
                            error = 500
                        for k in ("timings", "usage"):
                            if obj.get(k):
                                final[k] = obj[k]
                        if first is None and any(ch.get("text") for ch in obj.get("choices") or ()):
                            first = now
    except (aiohttp.ClientError, OSError, TimeoutError):
        error = 0  # cut off (openai_load.CUT_OFF)
    computed, cached = computed_tokens(final, len(prompt))
    return {"prompt": len(prompt), "computed": computed, "cached": cached, "error": error,
            "ttft_ms": None if first is None else round((first - sent) * 1000.0, 3)}


async def _drive(url: str, model: str | None, convs: list[list[list[int]]], concurrency: int,
                 answer_len: int, on_record) -> list[dict]:
    import aiohttp

    out: list[dict] = []
    # a new connection per request: llama.cpp's server closes kept-alive connections after a stream
    # (openai_load retries for it); loopback set-up costs both servers the same ~0.1 ms
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        for t in range(len(convs[0]) if convs else 0):
            todo = list(range(len(convs)))

            async def worker() -> None:
                while todo:
                    i = todo.pop(0)
                    r = await _one(session, url, model, convs[i][t], answer_len)
                    r.update(conv=i, turn=t)
                    out.append(r)
                    if on_record:
                        on_record(r)

            await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(convs))))))
    return out


def run(url: str, model: str | None, convs: list[list[list[int]]], concurrency: int, answer_len: int,
        on_record=None) -> list[dict]:
    """Drive the conversations against the server at `url`; one record per request."""
    return asyncio.run(_drive(url.rstrip("/"), model, convs, concurrency, answer_len, on_record))


def summarize(recs: list[dict]) -> dict:
    """TTFT P50/P99 (all turns, and turns after the first), prompt tokens computed, errors."""
    from tools.load.report import pct

    ok = [r for r in recs if r["error"] is None and r["ttft_ms"] is not None]
    ttft = [r["ttft_ms"] for r in ok]
    later = [r["ttft_ms"] for r in ok if r["turn"] > 0]
    known = [r for r in recs if r["computed"] is not None]
    prompt = sum(r["prompt"] for r in recs)
    computed = sum(r["computed"] for r in known) if len(known) == len(recs) else None
    return {"requests": len(recs), "errors": len(recs) - len(ok), "ttft_p50_ms": pct(ttft, 0.5),
            "ttft_p99_ms": pct(ttft, 0.99), "ttft_p50_later_turns_ms": pct(later, 0.5),
            "prompt_tokens": prompt, "prompt_tokens_computed": computed,
            "hit_rate": round(1 - computed / prompt, 3) if computed is not None and prompt else None}
