"""`npuserve serve`: start a board daemon (also what `make run` runs, with no arguments).

Flags override the config file, so one line starts a daemon for a test or a
demo. Exit status: 0 after SIGTERM/SIGINT, 2 for a configuration error, 1 when
start-up fails, 3 when serving becomes impossible (every chip out of service),
4 on an internal error. A daemon that cannot start says why in one
`startup_failed` log line before it exits (and before systemd hears READY=1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from engine.config import BACKENDS, LOG_FORMATS, Config, ConfigError, load_config
from engine.lora_config import with_lora_flags
from engine.daemon.log import configure as configure_log
from engine.daemon.log import log
from engine.exit_codes import EXIT_CONFIG, EXIT_STARTUP
from engine.flag_pairs import parse_pairs
from ipc.schema import NAME_RE


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve serve", description="Run a board daemon.")
    p.add_argument("--config", help="TOML config file (schema = \"npuserve/v1\")")
    p.add_argument("--endpoint", action="append", default=[], metavar="E",
                   help="ipc:///path or tcp://host:port to listen on (repeatable; replaces server.endpoints)")
    p.add_argument("--backend", choices=BACKENDS, help="chip runtime (board.backend)")
    p.add_argument("--chips", type=int, help="worker processes (board.chips)")
    p.add_argument("--board", help="board id (board.id)")
    p.add_argument("--runtime-dir", help="sockets and state (board.runtime_dir)")
    p.add_argument("--package", help="model package folder (model.package): the one-model shorthand")
    p.add_argument("--model-root", metavar="DIR", help="folder the model packages live under (model.root); "
                                                      "admin load/replace and --model cannot leave it")
    p.add_argument("--model", action="append", default=[], metavar="ALIAS=PACKAGE",
                   help="load PACKAGE (under the model root) as ALIAS at start-up (repeatable; the first is "
                        "the board's default unless model.alias names another)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve the LoRA adapter package PATH as model NAME on the board's model (repeatable; "
                        "adds to [[lora.adapter]]; docs/lora.md)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (metrics.port)")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="log lines on stderr: json (one object per line), human, or auto = human on a terminal "
                        "(log.format)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace JSON of jobs, request phases "
                                                   "and loop turns to FILE (open it in ui.perfetto.dev)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key as a dotted override, e.g. --set admission.max_waiting_requests=4")
    p.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra keyword for the backend constructor, e.g. --backend-option decode_base_ms=5")
    return p.parse_args(argv)


def overrides_from(args: argparse.Namespace) -> dict[str, object]:
    ov = parse_pairs(args.set, "--set")
    flags = {"board.backend": args.backend, "board.chips": args.chips, "board.id": args.board,
             "board.runtime_dir": args.runtime_dir, "model.package": args.package, "model.root": args.model_root,
             "metrics.port": args.metrics_port, "server.endpoints": args.endpoint or None,
             "log.format": args.log_format}
    ov.update({k: v for k, v in flags.items() if v is not None})
    return ov


def resolve_package(cfg: Config) -> str | None:
    """The package path the workers load: the configured one, or the built-in tiny model for `ref`/`llamacpp`."""
    if cfg.model.package:
        return cfg.model.package
    if cfg.board.backend == "ref":
        from workers.default_package import ensure_default_package

        return ensure_default_package()
    if cfg.board.backend == "llamacpp":
        from workers.default_package import ensure_default_gguf_package

        return ensure_default_gguf_package()
    return None


def startup_models(cfg: Config, named: list[str]) -> list[tuple[str, str | None, bool]]:
    """What to load at start-up: each --model ALIAS=PACKAGE (under the root), else the one-model package."""
    if not named:
        return [(cfg.model.alias, resolve_package(cfg), False)]
    out: list[tuple[str, str | None, bool]] = []
    for item in named:
        alias, sep, package = item.partition("=")
        alias, package = alias.strip(), package.strip()
        if not sep or not alias or not package:
            raise ConfigError(f"--model {item!r}: expected ALIAS=PACKAGE")
        if not NAME_RE.match(alias):
            raise ConfigError(f"--model {item!r}: an alias is 1-64 characters of [A-Za-z0-9_.:-], "
                              "not starting with [.:-]")
        if alias in [m[0] for m in out]:
            raise ConfigError(f"--model {item!r}: alias {alias!r} named twice")
        out.append((alias, package, True))
    return out


def banner(cfg: Config, aliases: list[str] | None = None) -> str:
    ep = cfg.server.endpoints[0]
    served = ", ".join(map(repr, aliases)) if aliases else repr(cfg.model.alias)
    lines = [
        f"npuserve: board {cfg.board.id} serving model{'s' if aliases and len(aliases) > 1 else ''} {served} "
        f"({cfg.board.backend} backend, {cfg.board.chips} chip{'s' if cfg.board.chips != 1 else ''})",
        "endpoint:",
        ep,
        "try:",
        f"  npuserve generate --endpoint {shlex.quote(ep)} --text \"hello\"",
        f"  npuserve health --endpoint {shlex.quote(ep)}",
        "stop with Ctrl-C (SIGINT) or SIGTERM: requests in flight finish first (server.drain_timeout_s); "
        "a second one stops at once",
    ]
    return "\n".join(lines)


def _startup_failed(exit_code: int, message: str, errors: list[str] | None = None) -> int:
    """The one log line of a daemon that cannot start: its cause, then the exit status systemd sees."""
    fields = {"errors": errors} if errors else {}
    log("startup_failed", exit_code=exit_code, message=message, **fields)
    return exit_code


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    configure_log("info", args.log_format or "auto")
    overrides: dict[str, object] = {}
    try:
        backend_extra = parse_pairs(args.backend_option, "--backend-option")
        overrides = overrides_from(args)
        cfg = with_lora_flags(load_config(args.config, overrides), args.lora)
    except ConfigError as e:
        return _startup_failed(EXIT_CONFIG, "configuration error: " + "; ".join(e.errors), e.errors)
    configure_log(cfg.log.level, cfg.log.format)
    from workers.heap_snapshots import ENV as HEAP_SNAPSHOTS_ENV
    from workers.heap_snapshots import install as install_heap_snapshots

    if install_heap_snapshots("daemon"):
        log("heap_snapshots_on", directory=os.environ[HEAP_SNAPSHOTS_ENV])

    from engine.daemon.daemon import Daemon, StartupError

    log("starting", board=cfg.board.id, backend=cfg.board.backend, chips=cfg.board.chips, config=args.config)
    try:
        models = startup_models(cfg, args.model)
    except ConfigError as e:
        return _startup_failed(EXIT_CONFIG, "configuration error: " + "; ".join(e.errors), e.errors)
    except Exception as e:  # a broken cache dir, an unwritable home: say so, do not trace back
        return _startup_failed(EXIT_STARTUP, f"cannot prepare the model package: {e}")
    daemon = Daemon(cfg, package_path=models[0][1], extra_backend_options=backend_extra,
                    config_loader=lambda: with_lora_flags(load_config(args.config, overrides), args.lora),
                    trace_path=args.trace,
                    models=models)
    try:
        daemon.start()
    except ConfigError as e:
        daemon.close()
        return _startup_failed(EXIT_CONFIG, "configuration error: " + "; ".join(e.errors), e.errors)
    except StartupError as e:
        daemon.close()
        if daemon.stop_requested:
            return 0  # SIGTERM/SIGINT while starting: a clean stop
        return _startup_failed(EXIT_STARTUP, f"cannot start: {e}")
    except OSError as e:  # e.g. a runtime directory we may not create
        daemon.close()
        return _startup_failed(EXIT_STARTUP, f"cannot start: {e}")
    except BaseException:
        daemon.close()
        raise
    if not daemon.service.notify.enabled:  # under systemd, STATUS= and the journal say it instead
        print(banner(cfg, sorted(daemon.models.published)), flush=True)
    try:
        return daemon.run()
    finally:
        daemon.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
