"""The benchmark command tree: at most four bench commands listed, every old `bench-*` name still parsing its old
flags into the new tree, and every `make bench-*` target naming a command that parses (nothing is run)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys

import pytest

from repo_root import ROOT
from tools import cli
from tools.bench import main as bench_main

# Old command lines as docs/benchmarks.md and the Makefile gave them, and the new command each must reach.
OLD = [
    ("bench-serve --backend sim --concurrency 64 --json", "npuserve bench serve point"),
    ("bench-serve --compare-framing --rounds 3 --backend stub", "npuserve bench serve point"),
    ("bench-http --backend llamacpp --threads 1 --rounds 5", "npuserve bench serve http"),
    ("bench-http-peer --scenario burst --threads 1 --rounds 2 --scenario-option ttft_ms=6000 "
     "--set admission.max_queue_wait_ms=3000", "npuserve bench serve http-peer"),
    ("bench-http-peer --conversations 8 --turns 4 --cache-ram 64", "npuserve bench serve http-peer"),
    ("bench-peer --concurrency 8,32 --shared-prefix --rounds 3", "npuserve bench serve peer"),
    ("bench-spec --streams 1,4,16 --rounds 2 --peer", "npuserve bench serve spec"),
    ("bench-structured --concurrency 8 --no-peer --json", "npuserve bench serve structured"),
    ("bench-balancer --daemons 2 --latency-requests 10 --json", "npuserve bench serve balancer"),
    ("bench-disagg --rates 1,2 --transfer zmq --plot x.png", "npuserve bench serve disagg"),
    ("bench-busy --backends ref,sim --modes sync,steps4 --rounds 2", "npuserve bench serve busy"),
    ("bench-observe --rounds 1 --requests 16", "npuserve bench serve observe"),
    ("bench-ipc --iters 10 --json", "npuserve bench micro ipc"),
    ("bench-kv-transfer --blocks 64 --repeats 3 --backend llamacpp --threads 2", "npuserve bench micro kv-transfer"),
    ("bench-kv-layout --streams 4 --reps 2", "npuserve bench micro kv-layout"),
    ("bench-backend --tp 1,2 --batches 1,16 --tp-repeats 4", "npuserve bench micro backend"),
    ("bench-backend --backend ctypes --loop-steps 8", "npuserve bench micro backend"),
    ("bench-recovery --backend stub --faults 2 --json", "npuserve bench recovery"),
    ("bench --backend sim --sweep 8,16 --per-slot 2 --slo ttft=2s,tpot=60ms --variant static:batch.static_batching=true",
     "npuserve bench serve"),
]


class Parsed(Exception):
    def __init__(self, prog: str, ns: argparse.Namespace) -> None:
        self.prog, self.ns = prog, ns


@pytest.fixture
def parse_only(monkeypatch):
    """`npuserve ARGV` as far as its argument parser: Parsed(prog, namespace), nothing run."""
    import signal

    real = argparse.ArgumentParser.parse_args

    def stop_after_parse(self, args=None, namespace=None):
        raise Parsed(self.prog, real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop_after_parse)
    handler = signal.getsignal(signal.SIGTERM)

    def run(argv: list[str]) -> Parsed:
        try:
            with pytest.raises(Parsed) as e:
                cli.main(argv)
        finally:
            signal.signal(signal.SIGTERM, handler)
        return e.value
    return run


def test_help_lists_at_most_four_bench_commands_and_none_of_the_old_names():
    out = subprocess.run([sys.executable, "-m", "tools.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout
    listed = [line.split()[0:2] for line in out.splitlines() if line.strip().startswith("bench")]
    assert 1 <= len(listed) <= 4, out
    assert not any(name in out.split() for name in bench_main.ALIASES), out


@pytest.mark.parametrize("line,prog", OLD, ids=[f"{i}-{o[0].split()[0]}" for i, o in enumerate(OLD)])
def test_an_old_command_parses_its_old_flags_in_the_new_tree(parse_only, line, prog):
    parsed = parse_only(shlex.split(line))
    assert parsed.prog == prog
    new = shlex.split(line)
    new[0:1] = ["bench", *bench_main.ALIASES.get(new[0], ("serve",))]
    assert vars(parse_only(new).ns) == vars(parsed.ns)  # the alias and the new command mean the same


def test_an_unknown_benchmark_is_a_usage_error_that_lists_them():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "micro", "nope"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "kv-transfer" in p.stderr and "http-peer" in p.stderr


def _make_targets() -> list[str]:
    with open(f"{ROOT}/Makefile") as f:
        text = f.read()
    benches = re.search(r"^BENCHES :=((?:.*\\\n)*.*)$", text, re.M).group(1)
    return benches.replace("\\\n", " ").split()


def test_every_make_bench_target_names_commands_that_parse(parse_only):
    targets = _make_targets()
    assert "bench-peer" in targets and "bench-scenario-burst" in targets
    stamp = ".venv/.installed-stamp"
    for target in targets:
        dry = subprocess.run(["make", "-n", "-o", stamp, target], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert dry.returncode == 0, (target, dry.stderr)
        commands = [c for line in dry.stdout.replace("\\\n", " ").splitlines()
                    for c in re.split(r"\|\||&&|;", line) if "bin/npuserve " in c]
        assert commands, (target, dry.stdout)
        for c in commands:
            argv = shlex.split(c)
            argv = argv[[i for i, w in enumerate(argv) if w.endswith("bin/npuserve")][0] + 1:]
            parsed = parse_only(argv)
            if argv[0] == "bench":
                assert parsed.prog.startswith("npuserve bench"), (target, parsed.prog)


def test_every_command_docs_benchmarks_names_parses(parse_only):
    """The figures of docs/benchmarks.md can be made again: each whole command its tables name beside a figure
    parses (placeholders, `[...]` or `...`, left out)."""
    with open(f"{ROOT}/docs/benchmarks.md") as f:
        text = "\n".join(line for line in f.read().splitlines() if line.startswith("|"))
    spans = re.findall(r"`(npuserve bench[^`]*)`", text)
    commands = [s for s in spans if not re.search(r"\.\.\.|\[|\||\bNAME\b|\bOPTIONS\b|\bN\b|--help", s)]
    assert len(commands) > 25
    for c in commands:
        argv = shlex.split(c)[1:]
        assert parse_only(argv).prog.startswith("npuserve bench"), c
