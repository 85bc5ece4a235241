"""llama.cpp's own HTTP server (xllamacpp `Server`) in a process of its own, for the HTTP benchmarks and tests.

xllamacpp's `Server` is llama.cpp's server (tools/server: its HTTP layer,
slots and continuous batching) linked into the wheel, so nothing is built or
downloaded: `python -m tools.load.llamacpp_server --gguf F --threads N
--parallel P` binds an ephemeral loopback port, prints its base URL as one
line on stdout, and serves until stdin closes or SIGTERM. A process of its
own, like the npuserve daemon it is compared with, so neither shares the
benchmark driver's interpreter.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass

from tools.load import child_process


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str

    def stop(self, timeout: float = 30.0) -> int:
        code = child_process.stop(self.proc, timeout)
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()
        return code


def start(gguf: str, *, threads: int, parallel: int, ctx_per_slot: int, api_key: str | None = None,
          cache_ram_mib: int | None = None, threads_http: int | None = None, swa_full: bool = False,
          loras: tuple[str, ...] | list[str] = (), timeout: float = 300.0) -> LocalServer:
    """Start the server on `gguf` with `parallel` slots of `ctx_per_slot` tokens; wait for its URL.

    `threads_http`: llama.cpp's HTTP threads (its default: `parallel` + 2). Each serves one connection
    while it is kept alive, so a load with more connections open than threads leaves the rest waiting
    for a thread, not for a slot. `loras`: LoRA GGUF files loaded unapplied (llama.cpp's `--lora` with
    `--lora-init-without-apply`), ids in this order: a request applies one with its `lora` list."""
    cmd = [sys.executable, "-m", "tools.load.llamacpp_server", "--gguf", gguf, "--threads", str(threads),
           "--parallel", str(parallel), "--ctx-per-slot", str(ctx_per_slot)]
    if threads_http:
        cmd += ["--threads-http", str(threads_http)]
    if api_key:
        cmd += ["--api-key", api_key]
    if cache_ram_mib is not None:
        cmd += ["--cache-ram", str(cache_ram_mib)]
    if swa_full:
        cmd += ["--swa-full"]
    for path in loras:
        cmd += ["--lora", path]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)  # it prints its URL once the model is loaded
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("http://"):
        proc.kill()
        proc.wait()
        raise SystemExit(f"llama.cpp's server did not start (exit {proc.returncode}, said {line!r}); "
                         f"run `{' '.join(cmd)}` to see why")
    return LocalServer(proc, line)


def main(argv: list[str]) -> int:
    import xllamacpp as xlc

    ap = argparse.ArgumentParser(prog="python -m tools.load.llamacpp_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=8, help="slots: streams decoded together")
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    ap.add_argument("--api-key", help="require `Authorization: Bearer KEY` (llama.cpp's --api-key)")
    ap.add_argument("--cache-ram", type=int, help="MiB of llama.cpp's host prompt cache (its --cache-ram; "
                                                  "default: llama.cpp's own, 8192; 0 disables it)")
    ap.add_argument("--threads-http", type=int, default=0, help="HTTP threads (0: llama.cpp's default)")
    ap.add_argument("--swa-full", action="store_true", help="a full-size sliding-window KV cache, as the "
                                                            "llamacpp backend keeps it (llama.cpp's --swa-full)")
    ap.add_argument("--lora", action="append", default=[], metavar="GGUF",
                    help="a LoRA adapter GGUF loaded unapplied (repeatable; id = its position): each request "
                         "selects with `lora: [{id, scale}]` (llama.cpp's --lora with --lora-init-without-apply)")
    a = ap.parse_args(argv)
    p = xlc.CommonParams()
    p.model.path = a.gguf
    p.n_parallel = a.parallel
    p.n_ctx = a.parallel * a.ctx_per_slot
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = a.threads
    p.port = a.port
    if a.api_key:
        p.api_keys = [a.api_key]
    if a.cache_ram is not None:
        p.cache_ram_mib = a.cache_ram
    if a.threads_http > 0:
        p.n_threads_http = a.threads_http
    p.swa_full = a.swa_full
    if a.lora:
        p.lora_adapters = [xlc.CommonAdapterLoraInfo(path, 1.0) for path in a.lora]
        p.lora_init_without_apply = True
    p.warmup = False
    p.endpoint_metrics = True  # /metrics: the scenarios read what the server computed (bench --scenario hangups)
    p.verbosity = -1
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    server = xlc.Server(p)
    sys.stdout.write(server.listening_address + "\n")
    sys.stdout.flush()
    while not stop:
        r, _, _ = select.select([sys.stdin], [], [], 0.5)
        if r and not sys.stdin.buffer.read1(4096):
            break
    del server  # stops llama.cpp's server loop and frees the model
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
