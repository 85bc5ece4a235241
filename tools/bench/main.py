"""`npuserve bench serve|micro|recovery`: every benchmark behind three commands.

* `bench serve [NAME] [OPTIONS]`: end to end through real servers. Without a
  NAME, the load generator (`tools.bench.serve.load`: closed or open loop,
  sweeps, SLO goodput, the Pareto frontier, `--variant`, scenarios,
  conversations; a daemon it starts, `--endpoint` a daemon or balancer,
  `--openai` any OpenAI-compatible server). With a NAME, one of the paired
  comparisons in `SERVE`.
* `bench micro NAME [OPTIONS]`: in-process measurements, `MICRO`.
* `bench recovery [OPTIONS]`: a chip back in service after its worker is killed or hung.

`npuserve bench [OPTIONS]` (no sub-command) is `bench serve [OPTIONS]`;
`npuserve bench --help` shows the tree. The `bench-*` names of the published
CLI (`bench-peer`, `bench-http`, ...) are `ALIASES`: hidden from
`npuserve --help`, same flags, each the `npuserve bench ...` it names.
"""

from __future__ import annotations

import importlib
import sys

# name: (module, argv put before the caller's, one-line help)
SERVE: dict[str, tuple[str, tuple[str, ...], str]] = {
    "point": ("tools.bench.serve.point", (), "one closed-loop point with the simulator's lengths; "
                                            "--compare-framing: batched events against one per message"),
    "http": ("tools.bench.serve.http", (), "the HTTP front against ZeroMQ on one daemon"),
    "http-peer": ("tools.bench.serve.http_peer", (), "npuserve against llama.cpp's server, both over HTTP "
                                                     "(uniform load, --scenario, --conversations)"),
    "peer": ("tools.bench.serve.peer", (), "npuserve (llamacpp) against llama.cpp's server engine, in-process"),
    "spec": ("tools.bench.serve.spec", (), "n-gram speculative decoding against plain decoding and llama.cpp's"),
    "structured": ("tools.bench.serve.structured", (), "JSON-schema constraints against none and llama.cpp"),
    "choices": ("tools.bench.serve.choices", (), "n > 1 choices' TTFT against n = 1"),
    "balancer": ("tools.bench.serve.balancer", (), "a balancer against direct daemon access; routing policies"),
    "disagg": ("tools.bench.serve.disagg", (), "a prefill/decode pair against co-location on two sim boards"),
    "busy": ("tools.bench.serve.busy", (), "executor modes (queued next step, ping/pong, multi-step) against sync"),
    "observe": ("tools.bench.serve.observe", (), "what metrics and tracing cost the daemon"),
    "mixed-load": ("tools.mixed_load", (), "each process's memory round by round under a steady mixed load"),
    "lora": ("tools.load.lora_mix", (), "LoRA (ref or sim): N adapters in a uniform mix against base-only "
                                        "requests; --backend llamacpp: the mix against llama.cpp's server"),
}
MICRO: dict[str, tuple[str, tuple[str, ...], str]] = {
    "ipc": ("tools.bench.micro.ipc", (), "shared-memory rings against other transports"),
    "kv-transfer": ("tools.bench.micro.kv_transfer", (), "the KV export/import path against a memcpy"),
    "kv-layout": ("tools.bench.micro.kv_layout", (), "the shared KV cell pool against a stream per slot (llamacpp)"),
    "backend": ("tools.bench.micro.backend", (), "a chip backend in-process and through a worker"),
    "tp": ("tools.bench.micro.backend", ("--tp", "1,2"), "tensor-parallel decode and the all-reduce (ref)"),
    "decode-loop": ("tools.bench.micro.backend", ("--backend", "ctypes", "--loop-steps", "8"),
                    "the C ABI's device-side multi-step decode against the host loop"),
    "http-client": ("tools.bench.micro.http_client", (), "what an SSE event costs the load client"),
}
RECOVERY = ("tools.bench.recovery", (), "a chip back in service after its worker is killed or hung")

# The published `bench-*` names, hidden from `npuserve --help`: name -> the `npuserve bench` argv it stands for.
ALIASES: dict[str, tuple[str, ...]] = {
    "bench-serve": ("serve", "point"),
    "bench-http": ("serve", "http"),
    "bench-http-peer": ("serve", "http-peer"),
    "bench-peer": ("serve", "peer"),
    "bench-spec": ("serve", "spec"),
    "bench-structured": ("serve", "structured"),
    "bench-balancer": ("serve", "balancer"),
    "bench-disagg": ("serve", "disagg"),
    "bench-busy": ("serve", "busy"),
    "bench-observe": ("serve", "observe"),
    "bench-ipc": ("micro", "ipc"),
    "bench-kv-transfer": ("micro", "kv-transfer"),
    "bench-kv-layout": ("micro", "kv-layout"),
    "bench-backend": ("micro", "backend"),
    "bench-recovery": ("recovery",),
}
LOAD = ("tools.bench.serve.load", (), "the load generator")

HELP = [("bench serve", "end to end through real servers: load, sweeps, SLO goodput, Pareto; paired comparisons"),
        ("bench micro", "in-process measurements: " + ", ".join(MICRO)),
        ("bench recovery", RECOVERY[2])]


def _table(title: str, table: dict) -> str:
    width = max(len(n) for n in table)
    return "\n".join([title] + [f"  {n.ljust(width)}  {h}" for n, (_, _, h) in table.items()])


def usage() -> str:
    return "\n\n".join([
        "usage: npuserve bench serve [NAME] [OPTIONS] | micro NAME [OPTIONS] | recovery [OPTIONS]",
        "bench serve without a NAME (or bench OPTIONS) is the load generator; `npuserve bench serve --help` "
        "lists its options",
        _table("bench serve NAME:", SERVE), _table("bench micro NAME:", MICRO)])


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """(module, its argv) for a `npuserve bench` command line; SystemExit(2) with the usage when it names nothing."""
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0)
    head, rest = (argv[0], argv[1:]) if argv else ("-", [])
    if head.startswith("-"):
        module, pre, _ = LOAD
        return module, [*pre, *argv]
    if head == "recovery":
        module, pre, _ = RECOVERY
        return module, [*pre, *rest]
    if head == "serve" and (not rest or rest[0].startswith("-")):
        module, pre, _ = LOAD
        return module, [*pre, *rest]
    table = {"serve": SERVE, "micro": MICRO}.get(head)
    if table is None or not rest or rest[0] not in table:
        print(f"npuserve bench: unknown benchmark {' '.join(argv[:2])!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module, pre, _ = table[rest[0]]
    return module, [*pre, *rest[1:]]


def main(argv: list[str]) -> int:
    module, args = resolve(list(argv))
    return int(importlib.import_module(module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
