"""/metrics bodies and the HTTP server that serves them, with one name per sample in either format.

A scraper may ask for OpenMetrics (Prometheus does, first) or for the plain
text format 0.0.4. prometheus_client renders a `npuserve:` name in both
formats' `# HELP`/`# TYPE` lines as it is, but in OpenMetrics it rewrites
every *sample* name's colon to `_` (its underscore escaping applies the
label-name alphabet to metric names: prometheus/client_python#1177), so
Prometheus would store `npuserve_chip_up` from one format and
`npuserve:chip_up` from the other. The documented names are vLLM's
convention (`vllm:` there, `npuserve:` here) and valid Prometheus metric
names, which a scraper stores as they are; so both formats are written with
the names kept: OpenMetrics with prometheus_client's `allow-utf-8` escaping,
which writes a valid legacy name unchanged (the same output a correct
underscore escaping gives, since `:` is legal in a metric name), and only
after checking that every name is such a legacy name.
"""

from __future__ import annotations

import gzip
import re
import socket
import threading
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import exposition as text_format
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as om_format
from prometheus_client.registry import Collector

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")  # Prometheus's metric names: colons allowed
LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def wants_openmetrics(accept: str | None) -> bool:
    """True when the Accept header names OpenMetrics (prometheus_client's own rule: any listed type)."""
    return any(part.split(";")[0].strip() == "application/openmetrics-text" for part in (accept or "").split(","))


class _Checked(Collector):
    """The families of some collectors, leaving out any whose name or label names a scraper could not store
    under the name written (none of ours; a guard for families that arrive as data, as the front's do)."""

    def __init__(self, sources: Iterable[Collector]) -> None:
        self.sources = tuple(sources)

    def collect(self) -> Iterator[Metric]:
        for src in self.sources:
            for m in src.collect():
                if METRIC_NAME_RE.match(m.name) and all(
                        METRIC_NAME_RE.match(s.name) and all(LABEL_NAME_RE.match(k) for k in s.labels)
                        for s in m.samples):
                    yield m


def render(sources: Iterable[Collector], accept: str | None) -> tuple[bytes, str]:
    """The exposition of `sources` (registries or collectors, in order) in the format `accept` asks for:
    (body, Content-Type). Sample names are the same in both formats."""
    reg = _Checked(sources)
    if wants_openmetrics(accept):
        if hasattr(om_format, "ALLOWUTF8"):  # prometheus_client >= 0.22 escapes; older ones wrote names as given
            return om_format.generate_latest(reg, escaping=om_format.ALLOWUTF8), OPENMETRICS_CONTENT_TYPE
        return om_format.generate_latest(reg), OPENMETRICS_CONTENT_TYPE
    return text_format.generate_latest(reg), TEXT_CONTENT_TYPE


class _Handler(BaseHTTPRequestHandler):
    sources: tuple = ()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/favicon.ico":
            self.send_error(404)
            return
        try:
            body, ctype = render(self.sources, self.headers.get("Accept"))
        except Exception as e:  # a collector that fails answers 500; the server keeps serving
            self.send_error(500, f"metrics collection failed: {e!r}")
            return
        if "gzip" in (self.headers.get("Accept-Encoding") or ""):
            body = gzip.compress(body)
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
        else:
            self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name): scrapes are not logged
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class MetricsHttp:
    """A running /metrics server: its bound port and how to stop it (the daemon's and the balancer's)."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve(host: str, port: int, sources: Iterable[Collector]) -> MetricsHttp:
    """Serve /metrics (any path) on host:port from a daemon thread. Raises OSError when it cannot bind."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    handler = type("MetricsHandler", (_Handler,), {"sources": tuple(sources)})
    server_cls = type("MetricsServer", (_Server,), {"address_family": family})
    server = server_cls((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsHttp(server, thread)
