"""The front's one link to its upstream (a board daemon or a balancer): one AsyncClient for every request.

One DEALER socket multiplexes all requests (the AsyncClient demultiplexes by
id; events are parsed without the per-field checks, the upstream being our
own daemon or balancer). A heartbeat (`health` every `health_interval_ms`) tells whether the
upstream answers: while it does not, new requests get 503 at once, and when
it stops answering, the requests in flight are ended with 503 and the socket
is replaced, so that nothing sent into the void is delivered to a restarted
upstream later. When it answers again the front serves again: no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from engine.async_client import AsyncClient
from engine.core.retry_after import clamp_ms
from engine.errors import ClientError
from engine.http.openai_error import OpenAIError
from engine.http.served_model import ServedModel, load_served_model

log = logging.getLogger("npuserve.http")


class Upstream:
    def __init__(self, endpoint: str, *, health_interval_s: float = 1.0, health_timeout_s: float = 2.0,
                 package: str | None = None, chat_template: str | None = None) -> None:
        self.endpoint = endpoint
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.package = package
        self.chat_template = chat_template  # Jinja2 source overriding the package's
        self.client = AsyncClient(endpoint, validate=False)
        self.up = False
        self.last_health: dict | None = None
        self.model: ServedModel | None = None  # the board's default model
        self.served: dict[str, ServedModel] = {}  # every Ready alias
        self.models: list[dict] = []  # their `models` entries
        self._task: asyncio.Task | None = None
        self._model_lock = asyncio.Lock()

    async def start(self) -> None:
        await self.check()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.client.close()

    def retry_after_ms(self) -> int:
        """When a request refused for want of the upstream may come back: its next health check."""
        return clamp_ms(self.health_interval_s)

    def unavailable(self) -> OpenAIError:
        return OpenAIError(503, f"the upstream {self.endpoint} does not answer; retry later",
                           code="upstream_unavailable", retry_after_ms=self.retry_after_ms())

    def require_up(self) -> AsyncClient:
        if not self.up:
            raise self.unavailable()
        return self.client

    async def check(self) -> bool:
        """Ask the upstream's health once; update `up` (and recover the socket when it went away)."""
        try:
            body = await self.client.health(timeout=self.health_timeout_s)
        except (ClientError, OSError) as e:
            if self.up:
                log.warning("upstream %s stopped answering (%s); in-flight requests get 503", self.endpoint, e)
                self._lost()
            return False
        self.last_health = body
        # (Re)learn the models before admitting requests: a restarted upstream may serve others, and a
        # board's admin may load, replace or unload one at any time.
        await self.refresh_models()
        if not self.up:
            log.info("upstream %s answers", self.endpoint)
        self.up = True
        return True

    async def refresh_models(self) -> None:
        """Learn the served models (`models` op: the Ready generations) and load the chat template and
        tokenizer of each alias whose package changed. Called on every heartbeat, so a model loaded,
        replaced or unloaded on the board is seen here within `health_interval_ms`."""
        async with self._model_lock:
            try:
                body = await self.client.call("models", timeout=self.health_timeout_s)
            except ClientError as e:
                log.warning("upstream %s: models failed: %s", self.endpoint, e)
                return
            models = [m for m in body.get("models") or [] if isinstance(m, dict) and m.get("alias")
                      and m.get("state", "ready") == "ready"]
            if not models:
                return
            served: dict[str, ServedModel] = {}
            adapters = [e for e in models if e.get("parent")]  # LoRA adapters: their base model's tokenizer
            models = [e for e in models if not e.get("parent")]
            if not models:
                return
            for entry in models:
                m = self.served.get(entry["alias"])
                path = self.package or entry.get("path") or entry.get("package")
                if m is None or (m.package, m.sha256) != (path, entry.get("sha256")):
                    m = await asyncio.to_thread(load_served_model, entry, self.package, self.chat_template)
                    if m.template is None:
                        log.info("model %s: no chat template (%s)", m.alias, m.problem)
                    elif m.chat_template.startswith("llama.cpp"):
                        log.info("model %s: chat template: %s", m.alias, m.chat_template)
                served[entry["alias"]] = m
            default = next((e for e in models if e.get("default")), models[0])
            for entry in adapters:
                base = served.get(entry["parent"])
                if base is not None:
                    served[entry["alias"]] = dataclasses.replace(base, alias=entry["alias"])
                    models.append(entry)
            self.models, self.served, self.model = models, served, served[default["alias"]]

    def model_for(self, name: str | None) -> ServedModel | None:
        """The served model a request names (None: the board's default)."""
        return self.model if name is None else self.served.get(name)

    def _lost(self) -> None:
        self.up = False
        self.client.abort_all(503, "upstream_unavailable", f"the upstream {self.endpoint} stopped answering",
                              self.retry_after_ms())
        self._replace_client()

    def _replace_client(self) -> None:
        old = self.client
        self.client = AsyncClient(self.endpoint, validate=False)
        asyncio.get_running_loop().create_task(old.close())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any one failure
                log.exception("upstream heartbeat failed")
