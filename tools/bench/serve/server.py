"""The server `npuserve bench serve` drives: a daemon it starts, `--endpoint` (a daemon or balancer), or
`--openai URL` (any OpenAI-compatible server, over HTTP).

`open_server` starts and waits for it, and stops what it started: a daemon
started here is stopped on the way out, its log tail shown when it exited
badly or the caller marked the run `failed`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

from tools.load.runner import Record
from tools.load.workload import Request


@dataclass
class Server:
    endpoint: str | None  # ZeroMQ; None for an HTTP server
    model: dict  # at least vocab_size and max_seq
    openai: str | None = None
    api_key: str | None = None
    model_id: str | None = None  # the `model` of each HTTP request
    failed: bool = False  # set by the caller: show the started daemon's log tail when it stops

    def send(self, requests: list[Request], *, concurrency: int | None, clients: int,
             on_record: Callable[[Record], None] | None = None) -> list[Record]:
        from tools.load import runner

        return runner.run(self.endpoint, requests, concurrency=concurrency, clients=clients, on_record=on_record,
                          openai=self.openai, api_key=self.api_key, model=self.model_id)


@contextlib.contextmanager
def open_server(a: argparse.Namespace, settings: list[str], prefix: str) -> Iterator[Server]:
    """The server of `a` (the load generator's --endpoint/--openai/--backend flags), up and answering."""
    from tools.load import local_daemon

    if a.openai:
        from tools.load.openai_load import probe

        served = probe(a.openai, a.api_key)
        yield Server(None, {"vocab_size": served["vocab_size"], "max_seq": served["max_seq"]}, a.openai, a.api_key,
                     a.model or served["id"])
        return
    d = server = None
    if not a.endpoint:
        d = local_daemon.start(backend=a.backend, chips=a.chips, settings=settings, backend_options=a.backend_option,
                               prefix=prefix, extra=a.daemon_arg)
    try:
        endpoint = a.endpoint or d.endpoint
        server = Server(endpoint, local_daemon.wait_healthy(endpoint, d)["model"])
        yield server
    finally:
        if d is not None:
            code = d.stop()
            if code != 0 or (server is not None and server.failed):
                sys.stderr.write(f"bench: daemon exited {code}; log tail:\n{d.log_tail()}\n")
            d.cleanup()
