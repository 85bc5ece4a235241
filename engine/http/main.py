"""`npuserve http`: the OpenAI-compatible HTTP front (starlette on uvicorn, uvloop + httptools).

    npuserve http --listen 127.0.0.1:8000 --upstream ENDPOINT [--api-keys FILE] [--config FILE]

Flags override the `[http]` section of `--config` (a board config file;
without `upstream` there, its first `server.endpoints` entry). Without
either, the upstream is the endpoint `make run` serves on. Exit status: 0
after SIGTERM/SIGINT, 2 for a configuration error, 1 when it cannot start.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from engine.config import LOG_LEVELS, HttpConfig, load_config
from engine.config_schema import BadValue, ConfigError, host_port, zmq_endpoint
from engine.exit_codes import EXIT_CONFIG


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve http", description="Serve the OpenAI API (/v1/completions, "
                                "/v1/chat/completions, /v1/models, /health, /metrics) in front of a daemon or "
                                "balancer.")
    p.add_argument("--listen", help="HOST:PORT to listen on (default 127.0.0.1:8000)")
    p.add_argument("--upstream", help="daemon or balancer endpoint (ipc:///path or tcp://host:port)")
    p.add_argument("--api-keys", help="file of `KEY TENANT` lines; without it the front is open")
    p.add_argument("--package", help="model package to read the chat template and tokenizer from "
                                     "(default: the one the upstream reports)")
    p.add_argument("--chat-template", help="file with a Jinja2 chat template to use instead of the package's")
    p.add_argument("--config", help="board config file; its [http] section (flags override it)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> tuple[HttpConfig, str]:
    """The [http] settings with the flags applied, and the upstream endpoint. Raises ConfigError."""
    if args.config:
        cfg = load_config(args.config)
        http = cfg.http
        base = os.path.dirname(os.path.abspath(args.config))
        fix = {k: os.path.join(base, v) for k in ("api_keys", "package", "chat_template")
               if (v := getattr(http, k)) and not os.path.isabs(v)}
        http = HttpConfig(**{**http.__dict__, **fix})
        upstream = http.upstream or cfg.server.endpoints[0]
    else:
        http = HttpConfig()
        upstream = ""
    errors = []
    over = {}
    for name, check in (("listen", host_port), ("upstream", zmq_endpoint)):
        v = getattr(args, name)
        if v is not None:
            try:
                over[name] = check(v)
            except BadValue as bad:
                errors.append(f"--{name}: {bad}")
    if errors:
        raise ConfigError(errors)
    if args.api_keys is not None:
        over["api_keys"] = os.path.abspath(args.api_keys)
    if args.package is not None:
        over["package"] = os.path.abspath(args.package)
    if args.chat_template is not None:
        over["chat_template"] = os.path.abspath(args.chat_template)
    http = HttpConfig(**{**http.__dict__, **over})
    upstream = over.get("upstream") or upstream
    if not upstream:
        from engine.client import default_endpoint

        upstream = default_endpoint()
    return http, upstream


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises the signal that stopped it after its graceful shutdown (so the process dies of
        it); the front exits 0 instead, as the daemon and balancer do."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return Server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        http, upstream_endpoint = settings_from(args)
        keys = None
        if http.api_keys:
            from engine.http.api_keys import ApiKeys, KeyFileError, load_key_file

            try:
                keys = ApiKeys(load_key_file(http.api_keys))
            except KeyFileError as e:
                raise ConfigError(str(e)) from None
        template = None
        if http.chat_template:
            try:
                with open(http.chat_template, encoding="utf-8") as fh:
                    template = fh.read()
            except OSError as e:
                raise ConfigError(f"chat template {http.chat_template}: cannot read it ({e.strerror})") from None
    except ConfigError as e:
        print("npuserve http: configuration error:\n  " + "\n  ".join(e.errors), file=sys.stderr)
        return EXIT_CONFIG
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    _Server = _server_class()
    from engine.http.app import Front, build_app
    from engine.http.upstream import Upstream

    upstream = Upstream(upstream_endpoint, health_interval_s=http.health_interval_ms / 1000.0,
                        health_timeout_s=http.health_timeout_ms / 1000.0, package=http.package or None,
                        chat_template=template)
    front = Front(upstream, keys=keys, default_temperature=http.default_temperature)
    host, port = http.listen.rsplit(":", 1)
    host = host.strip("[]")
    config = uvicorn.Config(build_app(front), host=host, port=int(port), loop="uvloop", http="httptools",
                            lifespan="on", access_log=False, proxy_headers=False, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = _Server(config)
    print(f"npuserve http: listening on http://{http.listen} (upstream {upstream_endpoint}, "
          f"{'API keys from ' + http.api_keys if keys else 'open: no API keys'})", file=sys.stderr, flush=True)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
