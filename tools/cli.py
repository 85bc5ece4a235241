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
    "make-lora": ("tools.make_lora_cmd", "write a random test LoRA adapter for a base model package"),
    "check-package": ("tools.check_package", "verify a model package and run its golden cases"),
    "import-gguf": ("tools.import_gguf", "make a model package around a GGUF file (llamacpp backend)"),
    "simulate": ("tools.simulate", "run the scheduler core against a virtual clock"),
    "install-systemd": ("tools.install_systemd_cmd", "install the npuserve@.service unit and a board config"),
    "install-monitoring": ("tools.monitoring.install_cmd", "write Prometheus config, alert rules and their tests, a Grafana dashboard"),
    "bench": ("tools.bench.main", "benchmarks: bench serve | bench micro NAME | bench recovery"),
    "soak": ("tools.soak.main", "steady mixed load for a duration, checking invariants, leaks and errors"),
    "heap-diff": ("tools.heap_diff", "what a daemon's or worker's Python heap gained between two heap snapshots"),
    "chaos": ("tools.chaos.main", "named fault scenarios under load, each with its invariant checks"),
    "balance": ("engine.balancer.main", "run a balancer in front of daemons or balancers"),
    "keygen": ("tools.keygen_cmd", "write a CURVE key pair (NAME.key, NAME.key_secret; 0600)"),
    "sign-package": ("tools.sign_package_cmd", "sign a model package's manifest (manifest.sig, Ed25519)"),
    "golden": ("tools.golden_cmd", "run a package's golden cases against a live endpoint"),
    "conformance": ("tools.conformance_cmd", "check a daemon or balancer against the wire protocol (docs/protocol.md)"),
    "admin": ("tools.admin_cmd", "manage a board's models: load, unload, replace, rollback, models"),
    "http": ("engine.http.main", "serve the OpenAI API over HTTP in front of a daemon or balancer"),
    "fuzz": ("tools.fuzz.main", "coverage-guided fuzzing (atheris) of the wire, HTTP and ring decoders"),
}


def _rows() -> list[tuple[str, str]]:
    """The listed commands: `bench` as its three sub-commands (the old `bench-*` names are hidden aliases)."""
    from tools.bench.main import HELP

    out = []
    for name, (_, help_) in COMMANDS.items():
        out += HELP if name == "bench" else [(name, help_)]
    return out


def _usage() -> str:
    rows = _rows()
    width = max(len(n) for n, _ in rows)
    lines = ["usage: npuserve COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, help_ in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools.bench.main import ALIASES

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name in ALIASES:  # an old `bench-*` name: the `npuserve bench ...` it stands for, same flags
        name, rest = "bench", [*ALIASES[name], *rest]
    if name not in COMMANDS:
        print(f"npuserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(COMMANDS[name][0]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
