"""The load driver for any OpenAI-compatible server: streamed `/v1/completions` over HTTP (aiohttp).

`npuserve bench --openai URL` runs the same workload as over ZeroMQ against
npuserve's HTTP front, llama.cpp's server or a vLLM: `runner` starts the
client processes and each drives its share through `OpenAIDriver` instead of
`AsyncClient`. One request is one `POST /v1/completions` with `stream: true`
and `stream_options.include_usage`, the prompt as token ids (or text with
`--text`), greedy unless the workload says otherwise, `ignore_eos` (an
extension llama.cpp, vLLM and npuserve's front accept) so output lengths are
the workload's. TTFT is taken at the first SSE content event, ITL between
content events, and the generated-token count from the server's `usage`
(exact, whatever the server coalesces into one event); without usage, one
token per content event.

aiohttp rather than httpx: at 64 streams on 2 cores the client must not be
the bottleneck, and streaming SSE costs ~7 µs per event through aiohttp
against ~40 µs through httpx (docs/benchmarks.md, "The load tool over HTTP").
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import orjson

from tools.load.sse import SseDecoder, SseEvent

# Error codes a record gets when the server gave none of its own.
CUT_OFF = 0  # connection refused or reset, or the stream ended without `data: [DONE]`
BAD_EVENT = 502  # an event that is not JSON


def base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the server at `http://h:p`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def completion_body(r: dict, model: str | None) -> dict:
    """The streamed `/v1/completions` body for one request of the runner's wire form (`runner._wire`)."""
    f = dict(r["fields"])
    body = {"prompt": r["text"] if r.get("text") is not None else r["prompt"], "max_tokens": f.pop("max_tokens"),
            "stream": True, "stream_options": {"include_usage": True}, "temperature": f.pop("temperature", 0.0)}
    if model:
        body["model"] = model
    tenant = f.pop("tenant", None)
    if tenant:
        body["user"] = tenant
    body.update(f)  # seed, ignore_eos and any further workload fields, under the same names
    return body


def error_code(obj: dict, status: int) -> int:
    """Our numeric code from an OpenAI-shaped error body (`{"error": {"code": ...}}`), else the HTTP status."""
    err = obj.get("error") if isinstance(obj, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    if isinstance(code, str) and code.isdigit():
        return int(code)
    return status if status >= 400 else 500


@dataclass(slots=True)
class StreamTally:
    """What one streamed completion said, event by event (`on_event`), then `finish()`: the record's fields."""

    sent: float
    first: float | None = None
    last: float | None = None
    events: int = 0  # content events (text or a token, however many tokens each carries)
    usage_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False  # `data: [DONE]` seen
    error: int | None = None
    gaps_ms: list[float] = field(default_factory=list)
    status: int | None = None  # the HTTP status, once the response began
    hang_up: int | None = None  # hang up once this many tokens arrived (a scenario's `disconnect_after`)
    disconnected: bool = False

    def on_event(self, ev: SseEvent, now: float) -> None:
        if ev.data == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(ev.data)
        except orjson.JSONDecodeError:
            self._fail(BAD_EVENT)
            return
        if not isinstance(obj, dict):
            self._fail(BAD_EVENT)
            return
        if ev.event == "error" or "error" in obj:
            self._fail(error_code(obj if "error" in obj else {"error": obj}, 500))
            return
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        for ch in obj.get("choices") or ():
            text = ch.get("text")
            if text is None and isinstance(ch.get("delta"), dict):  # a chat stream
                text = ch["delta"].get("content")
            reason = ch.get("finish_reason")
            if reason:
                self.finish_reason = reason
            if text or (text is not None and not reason):
                self._content(now)

    def _content(self, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            self.gaps_ms.append(round((now - self.last) * 1000.0, 3))
        self.last = now
        self.events += 1

    def _fail(self, code: int) -> None:
        if self.error is None:
            self.error = code

    def finish(self, code: int | None = None) -> None:
        """The stream ended (or failed with `code`): a stream that stopped before `[DONE]` was cut off."""
        if code is not None:
            self._fail(code)
        elif not self.done:
            self._fail(CUT_OFF)

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.events

    @property
    def hanging_up(self) -> bool:
        """The client has what it wanted before hanging up (counted in content events: usage comes last)."""
        return self.hang_up is not None and self.events >= self.hang_up

    def row(self, index: int, tenant: str) -> list:
        """The runner's record line: index, tenant, sent, first, last, tokens, error, ITL gaps (ms), whether
        the client hung up on purpose."""
        return [index, tenant, self.sent, self.first, self.last, self.tokens, self.error, self.gaps_ms,
                self.disconnected]


class OpenAIDriver:
    """One aiohttp session for a client process; `await one(r, write)` per request."""

    def __init__(self, spec: dict) -> None:
        self.url = base_url(spec["openai"])
        self.timeout = spec.get("timeout", 600)
        self.headers = {"content-type": "application/json"}
        if spec.get("api_key"):
            self.headers["authorization"] = f"Bearer {spec['api_key']}"
        self.model = spec.get("model")
        self.session = None
        self.fresh = None  # for a retry, see `one`

    async def __aenter__(self) -> "OpenAIDriver":
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout), headers=self.headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        if self.fresh is not None:
            await self.fresh.close()

    async def ready(self, streams: int = 1) -> None:
        """Before the clock starts: `streams` connections opened (concurrent `GET /v1/models`) and kept alive,
        so the first requests do not pay TCP set-up that the ZeroMQ client paid before its clock."""
        import asyncio

        async def models() -> None:
            async with self.session.get(self.url + "/v1/models") as resp:
                await resp.read()

        await asyncio.gather(*(models() for _ in range(max(1, streams))))

    async def one(self, r: dict, write) -> None:
        import aiohttp

        tally = StreamTally(time.time(), hang_up=r.get("disconnect_after"))
        body = orjson.dumps(completion_body(r, self.model))
        for session in (self.session, None):
            try:
                await self._stream(session or self._fresh_session(), body, tally)
                break
            except (aiohttp.ClientConnectionError, OSError) as e:
                # A pooled keep-alive connection the server closed after its last stream (llama.cpp's
                # server does, though it says keep-alive) fails before any response: send it again once,
                # on a new connection (the pool may hold more dead ones), as curl does. A failure once
                # the response began is the server's.
                if session is not None and tally.status is None and not isinstance(e, aiohttp.ClientConnectorError):
                    continue
                tally.finish(CUT_OFF)
                break
            except TimeoutError:
                tally.finish(CUT_OFF)
                break
        write(tally.row(r["index"], r["tenant"]))

    def _fresh_session(self):
        """A session whose connections are never pooled: each request gets a new one."""
        import aiohttp

        if self.fresh is None:
            self.fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                               timeout=self.session.timeout, headers=self.headers)
        return self.fresh

    async def _stream(self, session, body: bytes, tally: "StreamTally") -> None:
        async with session.post(self.url + "/v1/completions", data=body) as resp:
            tally.status = resp.status
            if resp.status != 200:
                raw = await resp.read()
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    obj = {}
                tally.finish(error_code(obj, resp.status))
                return
            dec = SseDecoder()
            async for chunk in resp.content.iter_any():
                now = time.time()
                for ev in dec.feed(chunk):
                    tally.on_event(ev, now)
                    if tally.hanging_up:
                        break
                if tally.hanging_up:
                    resp.close()  # drop the connection mid-stream, as a client that went away does
                    tally.disconnected = True
                    return
            tally.finish()


def probe(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict:
    """The served model, from `GET /v1/models`: {"id", "vocab_size", "max_seq"} (what the workload needs).

    `max_seq` is the model's `max_model_len` (vLLM, npuserve's front) or llama.cpp's per-server `n_ctx`,
    else 2048; `vocab_size` llama.cpp's `n_vocab`, else 256 (the workload draws ids below 256 anyway).
    """
    req = urllib.request.Request(base_url(url) + "/v1/models",
                                 headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"--openai {url}: GET /v1/models answered {e.code} "
                         f"({e.read()[:200]!r}); is this an OpenAI-compatible server, is --api-key right?") from None
    except (urllib.error.URLError, OSError) as e:
        raise SystemExit(f"--openai {url}: cannot reach the server ({e}); is it running on that address?") from None
    models = data.get("data") or []
    if not models:
        raise SystemExit(f"--openai {url}: GET /v1/models lists no model")
    m = models[0]
    meta = m.get("meta") or {}
    return {"id": m.get("id"), "vocab_size": int(m.get("vocab_size") or meta.get("n_vocab") or 256),
            "max_seq": int(m.get("max_model_len") or meta.get("n_ctx") or 2048)}
