"""The `npuserve` command: a table of subcommands, each imported lazily.

Every subcommand is a module with `main(argv: list[str]) -> int`; importing
only the chosen one keeps `npuserve --help` fast and keeps heavy imports
(numpy transformer, zmq) out of commands that do not need them.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help)
    "serve": ("engine.daemon.main", "run a board daemon"),
    "generate": ("tools.generate_cmd", "send one generate request and print the tokens"),
    "health": ("tools.health_cmd", "ask a daemon or balancer for its health"),
    "stats": ("tools.stats_cmd", "print a daemon's statistics"),
    "top": ("tools.top_cmd", "watch a daemon's metrics live"),
    "make-model": ("tools.make_model_cmd", "write a random-weight model package"),
    "check-package": ("tools.check_package", "verify a model package and run its golden cases"),
    "import-gguf": ("tools.import_gguf", "make a model package around a GGUF file (llamacpp backend)"),
    "bench-peer": ("tools.bench_peer", "benchmark npuserve (llamacpp) against llama.cpp's own server"),
    "bench-spec": ("tools.bench_spec", "speculative (n-gram) decoding against plain decoding and llama.cpp's server n-gram"),
    "bench-kv-layout": ("tools.bench_kv_layout", "what the shared KV cell pool costs a burst prefill (llamacpp)"),
    "simulate": ("tools.simulate", "run the scheduler core against a virtual clock"),
    "bench-ipc": ("tools.bench_ipc", "benchmark shared-memory rings against other transports"),
    "bench-kv-transfer": ("tools.bench_kv_transfer", "the KV export/import path against a memcpy; promote break-even"),
    "bench-backend": ("tools.bench_backend", "benchmark a chip backend in-process and through a worker"),
    "bench-serve": ("tools.bench_serve", "benchmark a daemon end to end through the client library"),
    "install-systemd": ("tools.install_systemd_cmd", "install the npuserve@.service unit and a board config"),
    "bench-observe": ("tools.bench_observe", "what metrics and tracing cost the daemon, side by side"),
    "bench-busy": ("tools.bench_busy", "keeping every chip busy: queued next steps and ping/pong against one in flight"),
    "bench": ("tools.bench", "load generator: closed/open loop, sweeps, SLO goodput, Pareto frontier"),
    "soak": ("tools.soak.main", "steady mixed load for a duration, checking invariants, leaks and errors"),
    "heap-diff": ("tools.heap_diff", "what a daemon's or worker's Python heap gained between two heap snapshots"),
    "chaos": ("tools.chaos.main", "named fault scenarios under load, each with its invariant checks"),
    "balance": ("engine.balancer.main", "run a balancer in front of daemons or balancers"),
    "bench-balancer": ("tools.bench_balancer", "benchmark a balancer against direct daemon access"),
    "bench-disagg": ("tools.bench_disagg", "prefill/decode disaggregation against co-location on two sim boards"),
    "keygen": ("tools.keygen_cmd", "write a CURVE key pair (NAME.key, NAME.key_secret; 0600)"),
    "sign-package": ("tools.sign_package_cmd", "sign a model package's manifest (manifest.sig, Ed25519)"),
    "golden": ("tools.golden_cmd", "run a package's golden cases against a live endpoint"),
    "conformance": ("tools.conformance_cmd", "check a daemon or balancer against the wire protocol (docs/protocol.md)"),
    "admin": ("tools.admin_cmd", "manage a board's models: load, unload, replace, rollback, models"),
    "http": ("engine.http.main", "serve the OpenAI API over HTTP in front of a daemon or balancer"),
    "bench-http": ("tools.bench_http", "benchmark the HTTP front against ZeroMQ on one daemon (its targets)"),
    "bench-http-peer": ("tools.bench_http_peer", "benchmark npuserve against llama.cpp's server, both over HTTP"),
    "bench-structured": ("tools.bench_structured", "what JSON-schema constraints cost, against none and llama.cpp"),
    "bench-recovery": ("tools.bench_recovery", "time a chip back in service after its worker is killed or hung"),
    "fuzz": ("tools.fuzz.main", "coverage-guided fuzzing (atheris) of the wire, HTTP and ring decoders"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: npuserve COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"npuserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
