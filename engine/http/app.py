"""The starlette routes of the OpenAI-compatible front: the shell around openai_request/openai_response.

Per request: authenticate (API key -> tenant), validate the body, check the
model, send one `generate` per choice to the upstream over the shared
AsyncClient, and answer: one JSON object, or server-sent events where every
batch of upstream events that arrived in one receive burst (one event-loop
turn) leaves as ONE write. The HTTP client going away cancels the upstream
requests (streams and non-streams alike).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.errors import ClientError
from engine.http.api_keys import ApiKeys
from engine.http.chat_template import no_template
from engine.http.metrics import HttpMetrics
from engine.http import kv_transfer
from engine.http.choices import best, expand, fold, prompt_counted_once, prompt_once, staggered_batches
from engine.http.logprob_objects import completion_answer, prompt_text
from engine.http.openai_error import OpenAIError, bad, from_upstream
from engine.http.openai_request import GenerateRequest, parse_chat, parse_completion, tenant_of_user
from engine.http.openai_response import (
    DONE, ChunkWriter, chat_logprobs, chat_object, completion_object, error_event, new_id, usage,
)
from engine.http.stream_encoder import StreamEncoder
from engine.http import tool_prompt
from engine.http.tool_calls import parse_answer
from engine.http.tool_stream import ToolStreamEncoder
from engine.http.served_model import ServedModel
from engine.http.upstream import Upstream
from ipc.codec import PROTOCOL_VERSION
from ipc.schema import NAME_RE

log = logging.getLogger("npuserve.http")
JSON = "application/json"
MAX_BODY_BYTES = 32 << 20  # a prompt of 2^20 characters, JSON-escaped, fits with room; the upstream checks the rest
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


@dataclass
class Prepared:
    """A validated request turned into the upstream messages of its choices."""

    req: GenerateRequest
    model: str  # the `model` the response names
    msgs: list[dict]
    prompt_text: list[str | None]  # what the render endpoints show
    served: ServedModel | None = None  # its tokenizer and template (None: not learned yet)
    per_prompt: int = 1  # choices generated per prompt (n or best_of: engine/http/choices.py)


def json_response(obj, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type=JSON)


def error_response(e: OpenAIError) -> Response:
    return Response(e.json(), status_code=e.status, media_type=JSON, headers=e.headers())


async def wait_disconnect(receive) -> None:
    """Return when the ASGI server reports the client gone (the body has been read already)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class Hangup:
    """Watches one request for `http.disconnect` and, if the client leaves while the request is served,
    cancels the request's own task (whose upstream iterators then cancel the requests upstream).

    One idle task per request, nothing per token, and the request is served inline in uvicorn's task:
    no extra task turn stands between a token arriving and its write (that is most of the front's added
    TTFT when many streams share the loop).
    """

    __slots__ = ("task", "gone", "serving", "_watcher")

    def __init__(self, receive) -> None:
        self.task = asyncio.current_task()
        self.gone = False
        self.serving = True
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        await wait_disconnect(receive)
        if self.serving:  # after the last byte, uvicorn reports every request "disconnected"
            self.gone = True
            self.task.cancel()

    def absorb(self) -> bool:
        """In `except CancelledError`: True, and the cancellation taken back, when it was the hang-up."""
        if not self.gone:
            return False
        self.task.uncancel()
        return True

    def stop(self) -> None:
        self.serving = False
        self._watcher.cancel()


class SSEResponse(Response):
    """Server-sent events: `first`, then the chunks of `chunks`; `hangup` ends it when the client leaves."""

    def __init__(self, first: bytes, chunks: AsyncIterator[bytes], hangup: Hangup, on_end) -> None:
        super().__init__(status_code=200)
        self.first = first
        self.chunks = chunks
        self.hangup = hangup
        self.on_end = on_end  # called with "done" | "disconnect" | "error"

    async def __call__(self, scope, receive, send) -> None:
        outcome = "done"
        try:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.hangup.serving = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.hangup.absorb():
                raise
            outcome = "disconnect"
        except OSError:
            outcome = "disconnect"
        except Exception:  # noqa: BLE001 - the status line is sent: log, end the stream
            outcome = "error"
            log.exception("stream failed")
        finally:
            self.hangup.stop()
            with contextlib.suppress(Exception):
                await self.chunks.aclose()
            self.on_end(outcome)


class Front:
    """The routes' state: upstream link, keys, settings, metrics."""

    def __init__(self, upstream: Upstream, *, keys: ApiKeys | None = None, default_temperature: float = 1.0,
                 metrics: HttpMetrics | None = None) -> None:
        self.upstream = upstream
        self.keys = keys
        self.default_temperature = default_temperature
        self.metrics = metrics or HttpMetrics()

    # -- helpers -------------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str | None:
        """The key's tenant (401 for a missing/unknown key); None on an open front (then `user` decides)."""
        if self.keys is None:
            return None
        return self.keys.tenant_for(request.headers.get("authorization"))

    @staticmethod
    async def _json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise OpenAIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
        data = await request.body()
        if len(data) > MAX_BODY_BYTES:
            raise OpenAIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise bad(None, f"the body is not valid JSON: {e}", "invalid_json") from None

    def _served(self, req: GenerateRequest):
        """The served model a request names (404 for a name the board does not serve); None when the
        upstream has not said what it serves."""
        m = self.upstream.model_for(req.model)
        names = {x.get("alias") for x in self.upstream.models}
        # a name no alias can have is never served, whether or not the upstream has said what it serves
        if req.model is not None and (names and req.model not in names or not NAME_RE.match(req.model)):
            served = f" (served: {', '.join(sorted(n for n in names if n))})" if names else ""
            raise OpenAIError(404, f"the model {req.model[:200]!r} does not exist here{served}", param="model",
                              code="model_not_found")
        return m

    def prepare(self, req: GenerateRequest, key_tenant: str | None, render_only: bool = False) -> Prepared:
        served = self._served(req)
        base = {"v": PROTOCOL_VERSION, "op": "generate", "id": "", "stream": req.stream,
                "tenant": key_tenant or tenant_of_user(req.user)}
        if req.model is not None:
            base["model"] = req.model
            parent = next((m.get("parent") for m in self.upstream.models if m.get("alias") == req.model), None)
            if parent:  # a LoRA adapter: its base model and the adapter (a balancer routes by the base)
                base["model"], base["adapter"] = parent, req.model
        if req.logprobs:
            base["logprobs"] = True
        if req.handoff is not None:
            base["handoff"] = req.handoff
        for k, v in req.sampling.items():
            if v is not None:
                base[k] = v
        msgs: list[dict] = []
        texts: list[str | None] = []
        if req.kind == "chat":
            name = req.model or (served.alias if served else "")
            if served is None:
                raise OpenAIError(503, "the front has not learned the served model from the upstream yet",
                                  code="upstream_unavailable", retry_after_ms=self.upstream.retry_after_ms())
            if served.template is None:
                raise no_template(name) if not served.problem else OpenAIError(
                    400, f"model {name!r} has no chat template: {served.problem}", param="messages",
                    code="no_chat_template")
            text = tool_prompt.render(served.template, req.messages, req.tools, req.add_generation_prompt,
                                      req.template_kwargs)
            ids = served.chat_prompt(text)
            if base.get("max_tokens") is None:
                room = served.max_seq - len(ids)
                if room < 1:
                    raise bad("messages", f"the conversation is {len(ids)} tokens, the model's context is "
                                          f"{served.max_seq}: no room to answer", "context_length_exceeded")
                base["max_tokens"] = room
            msgs.append(dict(base, prompt=ids))
            texts.append(text)
        else:
            for p in req.prompts:
                msgs.append(dict(base, text=p) if type(p) is str else dict(base, prompt=p))
                texts.append(p if type(p) is str else None)
        per_prompt = req.best_of or req.n
        if not render_only:
            msgs = expand(msgs, per_prompt, score=per_prompt > req.n)
        client = self.upstream.client if render_only else self.upstream.require_up()
        for m in msgs:
            m["id"] = client.new_id()
        model = req.model or (served.alias if served else "")
        return Prepared(req, model, msgs, texts, served, per_prompt)

    # -- generation -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat", parse_chat)

    async def _generate(self, request: Request, endpoint: str, parse) -> Response:
        t0 = time.perf_counter()
        hangup = response = None
        try:
            tenant = self._tenant(request)
            req = parse(await self._json(request), self.default_temperature)
            prep = self.prepare(req, tenant)
            hangup = Hangup(request.receive)
            serve = self._stream if req.stream else self._whole
            response = await serve(prep, endpoint, t0, hangup)
            return response
        except OpenAIError as e:
            self._finish(endpoint, e.status, t0)
            return error_response(e)
        except asyncio.CancelledError:
            if hangup is None or not hangup.absorb():
                raise
            self.metrics.disconnects.inc()
            self._finish(endpoint, 499, t0)
            return Response(status_code=499)
        except Exception:  # noqa: BLE001 - one bad request must not take the front down
            log.exception("%s failed", endpoint)
            self._finish(endpoint, 500, t0)
            return error_response(OpenAIError(500, "internal error in the HTTP front", code="internal_error"))
        finally:
            if hangup is not None and not isinstance(response, SSEResponse):  # a stream's response owns it
                hangup.stop()

    def _finish(self, endpoint: str, status: int, t0: float) -> None:
        self.metrics.count(endpoint, status)
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def _collect(self, prep: Prepared) -> list[dict]:
        """The `done` event of every choice (non-streamed on the wire); an upstream error raises."""
        client = self.upstream.client

        async def one(msg: dict) -> dict:
            async with contextlib.aclosing(client.stream_batches(msg)) as it:
                async for batch in it:
                    last = batch[-1]
                    if last.get("ev") == "error":
                        raise from_upstream(last)
                    if last.get("ev") == "done":
                        return last
            raise OpenAIError(502, "the upstream ended a request without a terminal event")

        if len(prep.msgs) == 1:
            return [await one(prep.msgs[0])]
        if prep.per_prompt > 1:  # n / best_of: streamed upstream, siblings after their leader
            folded: list[dict | None] = [None] * len(prep.msgs)
            async with contextlib.aclosing(staggered_batches(client, prep.msgs, prep.per_prompt)) as it:
                async for i, batch in it:
                    if batch[-1].get("ev") == "error":
                        raise from_upstream(batch[-1])
                    folded[i] = fold(batch, folded[i])
            return folded
        tasks = [asyncio.ensure_future(one(m)) for m in prep.msgs]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()
            return [t.result() for t in tasks]
        finally:  # one choice failed or the client left: the others are cancelled upstream too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _whole(self, prep: Prepared, endpoint: str, t0: float, hangup: Hangup) -> Response:
        self.metrics.in_flight.inc()
        try:
            dones = await self._collect(prep)
        finally:
            self.metrics.in_flight.dec()
        req, served = prep.req, prep.served
        token_text = served.token_text if served else (lambda t: f"token_id:{t}")
        created = int(time.time())
        m = prep.per_prompt
        usages = [prompt_once(d.get("usage") or {}, i, m) for i, d in enumerate(dones)]
        kept = best(dones, m, req.n) if m > req.n else list(range(len(dones)))
        if req.kind == "chat":
            choices = []
            for k, i in enumerate(kept):
                d = dones[i]
                lp = chat_logprobs(d.get("tokens") or [], d.get("logprobs") or [], token_text,
                                   d.get("top_logprobs")) if req.logprobs else None
                calls = parse_answer(d.get("text") or "", req.tools) if req.tools and req.tools.active else None
                choices.append(chat_object(new_id("chat"), prep.model, created, d.get("text") or "",
                                           d.get("finish_reason"), {}, lp, calls)["choices"][0] | {"index": k})
            obj = chat_object(new_id("chat"), prep.model, created, "", None, {}, None)
            obj["choices"], obj["usage"] = choices, usage(usages)
        else:
            choices = []
            for k, i in enumerate(kept):
                choices.append(completion_answer(req, k, dones[i], req.prompts[i // m], token_text))
            obj = completion_object(new_id("completion"), prep.model, created, choices, usages)
        if req.handoff is not None and req.handoff.get("export"):  # vllm-router's prefill leg
            board = (getattr(self.upstream, "last_health", None) or {}).get("board")
            obj[kv_transfer.FIELD] = kv_transfer.response_params(dones[0], prep.msgs[0]["id"],
                                                                 f"board-{board}" if board else "npuserve")
        self._finish(endpoint, 200, t0)
        return json_response(obj)

    async def _stream(self, prep: Prepared, endpoint: str, t0: float, hangup: Hangup) -> Response:
        req = prep.req
        served = prep.served
        n = len(prep.msgs)
        writer = ChunkWriter(req.kind, new_id(req.kind), prep.model, req.include_usage)
        token_text = served.token_text if served else (lambda t: f"token_id:{t}")
        if req.tools is not None and req.tools.active:
            enc = ToolStreamEncoder(writer, n, logprobs=req.logprobs, token_text=token_text, spec=req.tools)
        else:
            enc = StreamEncoder(writer, n, logprobs=req.logprobs, token_text=token_text,
                                echo=[prompt_text(req.prompts[i // prep.per_prompt], token_text)
                                      for i in range(n)] if req.echo else None)
        metrics = self.metrics
        first_at: list[float] = []

        def encode(i: int, batch: list[dict]) -> bytes:
            """One write for one batch; the front's TTFT figures of a single-choice stream on the way."""
            out = enc.encode(i, batch)
            if not first_at and enc.started:
                first_at.append(time.perf_counter())
                if n == 1:
                    metrics.ttft.observe(first_at[0] - t0)
            end = batch[-1]
            if n == 1 and first_at and end.get("ev") == "done":
                up_ttft = (end.get("timing") or {}).get("ttft_ms")
                if up_ttft is not None:
                    metrics.added_ttft.observe(max(0.0, first_at[0] - t0 - up_ttft / 1000.0))
            return out

        # One choice (nearly every stream): its batches straight from the client, no merging generator between.
        single = n == 1
        batches = self.upstream.client.stream_batches(prep.msgs[0]) if single else \
            staggered_batches(self.upstream.client, prep.msgs, 1) if prep.per_prompt == 1 else \
            prompt_counted_once(staggered_batches(self.upstream.client, prep.msgs, prep.per_prompt),
                                prep.per_prompt)
        metrics.in_flight.inc()
        # Wait for the first batch before the status line: an upstream error (429, 400 prompt too long, ...)
        # is then still an HTTP status, not an event inside a 200 stream.
        try:
            item = await batches.__anext__()
            first = enc.head() + (encode(0, item) if single else encode(*item))
        except BaseException:
            metrics.in_flight.dec()
            with contextlib.suppress(BaseException):
                await batches.aclose()
            raise

        async def rest() -> AsyncIterator[bytes]:
            try:
                chunk = b""
                if enc.left:
                    async for item in batches:
                        try:
                            chunk = encode(0, item) if single else encode(*item)
                        except OpenAIError as e:  # an error after the status line: one error event, then the end
                            yield error_event(e.body()) + DONE
                            return
                        if not enc.left:
                            break
                        yield chunk
                        chunk = b""
                yield chunk + enc.tail() + DONE
            finally:
                await batches.aclose()

        def on_end(outcome: str) -> None:
            metrics.in_flight.dec()
            if outcome == "disconnect":
                metrics.disconnects.inc()
            self._finish(endpoint, 200 if outcome == "done" else 499, t0)

        return SSEResponse(first, rest(), hangup, on_end)

    # -- render (vllm-router's cache_aware policy asks for these) ----------------------------------
    async def render_completions(self, request: Request) -> Response:
        return await self._render(request, "completions_render", parse_completion)

    async def render_chat(self, request: Request) -> Response:
        return await self._render(request, "chat_render", parse_chat)

    async def _render(self, request: Request, endpoint: str, parse) -> Response:
        """The prompt token ids the board would prefill, without generating (vllm-router's cache_aware policy
        keys its prefix tree on them): completions `[{"token_ids", "prompt"}, ...]` one per prompt, chat one
        `{"token_ids", "prompt"}` (template applied). No upstream round trip: the front tokenizes itself."""
        t0 = time.perf_counter()
        try:
            tenant = self._tenant(request)
            req = parse(await self._json(request), self.default_temperature)
            prep = self.prepare(req, tenant, render_only=True)
            out = [{"token_ids": self._prompt_ids(msg, prep.served), "prompt": text}
                   for msg, text in zip(prep.msgs, prep.prompt_text)]
            self._finish(endpoint, 200, t0)
            return json_response(out[0] if req.kind == "chat" else out)
        except OpenAIError as e:
            self._finish(endpoint, e.status, t0)
            return error_response(e)

    def _prompt_ids(self, msg: dict, served: ServedModel | None) -> list[int]:
        """The token ids of a prepared generate message (its `text` tokenized as the daemon does)."""
        if "prompt" in msg:
            return msg["prompt"]
        if served is None or served.tokenizer is None:
            raise OpenAIError(503, "the front does not know the model's tokenizer yet (the upstream has not "
                                   "answered)", code="upstream_unavailable",
                              retry_after_ms=self.upstream.retry_after_ms())
        return served.tokenizer.encode(msg["text"])

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize` (`{"model", "prompt"}` -> `{"tokens", "count", "max_model_len"}`): the router's
        fallback when render is missing, and handy for clients."""
        try:
            self._tenant(request)
            body = await self._json(request)
            if type(body) is not dict or type(body.get("prompt")) is not str:
                raise bad("prompt", "must be a string", "invalid_type")
            if body.get("model") is not None and type(body["model"]) is not str:
                raise bad("model", "must be a string", "invalid_type")
            served = self._served(GenerateRequest("completion", body.get("model"), False, False, False, None, {}))
            ids = self._prompt_ids({"text": body["prompt"]}, served)
        except OpenAIError as e:
            return error_response(e)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": served.max_seq if served else None})

    # -- the rest ----------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
            if not self.upstream.models:
                self.upstream.require_up()
                await self.upstream.refresh_models()
            if not self.upstream.models:
                raise self.upstream.unavailable()
        except OpenAIError as e:
            return error_response(e)
        served = self.upstream.served
        data = [{"id": m["alias"], "object": "model", "created": 0, "owned_by": "npuserve",
                 "max_model_len": m.get("max_seq") or (served[m["alias"]].max_seq if m["alias"] in served else None),
                 "chat_template": (served[m["alias"]].chat_template or None) if m["alias"] in served else None,
                 **({"parent": m["parent"]} if m.get("parent") else {})}  # a LoRA adapter: its base model
                for m in self.upstream.models]
        return json_response({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        answered = await self.upstream.check()
        h = self.upstream.last_health or {}
        if answered and h.get("ok", True):
            return json_response({"status": "ok", "upstream": self.upstream.endpoint})
        why = "does not answer" if not answered else "answers but is not ok (draining, no chip up or stalled)"
        return json_response({"status": "unavailable", "upstream": self.upstream.endpoint,
                              "message": f"the upstream {why}"}, 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        families = None
        if self.upstream.up:
            try:
                stats = await self.upstream.client.stats(timeout=self.upstream.health_timeout_s)
                families = stats.get("metrics")
            except ClientError:
                families = None
        body, ctype = self.metrics.exposition(families, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": ctype})


def build_app(front: Front) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await front.upstream.start()
        try:
            yield
        finally:
            await front.upstream.close()

    routes = [
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat, methods=["POST"]),
        Route("/v1/completions/render", front.render_completions, methods=["POST"]),
        Route("/v1/chat/completions/render", front.render_chat, methods=["POST"]),
        Route("/tokenize", front.tokenize, methods=["POST"]),
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/health", front.health, methods=["GET"]),
        Route("/metrics", front.metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
