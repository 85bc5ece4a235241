"""`npuserve admin --endpoint E load|unload|replace|rollback|models|drain|resume ... [--json]`: manage a board.

    models                          list the models: alias, generation, state, sha256, package, counters
    load ALIAS PACKAGE              gate, configure, golden-check and warm up PACKAGE, then publish it as ALIAS
    unload ALIAS [--deadline S]     drain ALIAS (new requests 503) and free it
    replace ALIAS PACKAGE [--deadline S]   a new generation of ALIAS from PACKAGE
    rollback ALIAS [--deadline S]   ALIAS back to its previous package
    drain [--timeout S] [--backend E]   stop admitting (503 draining); in-flight requests get S seconds
                                    (default: the board's server.drain_timeout_s), then are ended
    resume [--backend E]            admit again
    reenable-inflight [--chip N]    ping/pong back on after its automatic downgrade (every chip, or N)
    load-lora NAME ADAPTER [--base ALIAS]   check the LoRA adapter package ADAPTER and serve it as model NAME
    unload-lora NAME                new requests for NAME get 404; running ones finish on it (docs/lora.md)

PACKAGE is a folder inside the board's model root (relative to it, or an
absolute path inside it). A long operation shows the elapsed time on stderr.
Exit status: 0 done; 1 the daemon refused or failed the operation (the load
step and cause are printed); 2 usage or connection error (with a hint).
The wire contract is in docs/protocol.md ("Model lifecycle ops").
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import orjson

from engine.client import Client, default_endpoint
from engine.errors import ClientError, ClientTimeout
from ipc.schema import MAX_DEADLINE_MS

PROG = "npuserve admin"
LONG_OP_TIMEOUT_S = 600.0  # load/replace run golden cases and warm-up: seconds to minutes
SHORT_OP_TIMEOUT_S = 10.0
MAX_DRAIN_TIMEOUT_S = MAX_DEADLINE_MS / 1000.0  # the protocol's timeout_ms bound
SHORT_OPS = ("models", "drain", "resume", "reenable-inflight", "unload-lora")  # answered at once


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """--endpoint/--timeout/--json, accepted before and after the subcommand."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    parser.add_argument("--endpoint", default=d(None), help="board endpoint (default: the local board's)")
    parser.add_argument("--timeout", type=float, default=d(None),
                        help=f"seconds to wait for the reply (default {SHORT_OP_TIMEOUT_S:g} for models, "
                             f"{LONG_OP_TIMEOUT_S:g} otherwise)")
    parser.add_argument("--json", action="store_true", default=d(False), help="one JSON object per line")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n")[1])
    _common(ap, suppress=False)
    sub = ap.add_subparsers(dest="op", required=True, metavar="OP")

    def op(name: str, help_: str, package: bool, deadline: bool) -> None:
        p = sub.add_parser(name, help=help_)
        _common(p, suppress=True)
        if name != "models":
            p.add_argument("alias", help="model alias")
        if package:
            p.add_argument("package", help="package folder inside the board's model root")
        if deadline:
            p.add_argument("--deadline", type=float, default=None, dest="deadline_s", metavar="S",
                           help="seconds the old generation's requests get to finish (default: the board's "
                                "server.drain_timeout_s)")

    op("models", "list the board's models", package=False, deadline=False)
    op("load", "load a package under a new alias", package=True, deadline=False)
    op("unload", "drain and unload a model", package=False, deadline=True)
    op("replace", "serve a new package under an existing alias", package=True, deadline=True)
    op("rollback", "go back to an alias's previous package", package=False, deadline=True)
    for name, help_ in (("drain", "stop admitting new requests; in-flight ones finish or are ended after --timeout"),
                        ("resume", "admit new requests again after a drain")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--endpoint", default=argparse.SUPPRESS, help="board or balancer endpoint")
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="one JSON object")
        p.add_argument("--backend", default=None, metavar="E",
                       help="at a balancer: drain (or resume) only this backend endpoint")
        if name == "drain":  # here --timeout is the drain's budget; the reply itself comes at once
            p.add_argument("--timeout", type=float, default=None, dest="drain_timeout_s", metavar="S",
                           help="seconds in-flight requests get before they are ended (timeout_ms; default: "
                                "the board's server.drain_timeout_s; a balancer without it lets them finish)")
    p = sub.add_parser("load-lora", help="load a LoRA adapter package as a model id")
    _common(p, suppress=True)
    p.add_argument("alias", help="the adapter's name (the model id requests name)")
    p.add_argument("package", help="adapter package folder (inside the board's model root when it has one)")
    p.add_argument("--base", default=None, help="the model alias it adapts (default: the board's model)")
    p = sub.add_parser("unload-lora", help="unload a LoRA adapter (running requests finish on it)")
    _common(p, suppress=True)
    p.add_argument("alias", help="the adapter's name")
    p = sub.add_parser("reenable-inflight", help="ping/pong back on after its automatic downgrade")
    _common(p, suppress=True)
    p.add_argument("--chip", type=int, default=None, help="only this chip (default: every chip)")
    a = ap.parse_args(argv)
    if getattr(a, "deadline_s", None) is not None and a.deadline_s < 0:
        ap.error("--deadline must be >= 0")
    if getattr(a, "drain_timeout_s", None) is not None and not 0 <= a.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:
        ap.error(f"--timeout must be 0..{MAX_DRAIN_TIMEOUT_S:g} seconds")
    return a


def request_fields(a: argparse.Namespace) -> dict:
    """The op's wire fields (docs/protocol.md): alias, package, deadline_s, as given."""
    fields = {k: getattr(a, k) for k in ("alias", "package", "deadline_s", "backend", "chip", "base")
              if getattr(a, k, None) is not None}
    if getattr(a, "drain_timeout_s", None) is not None:
        fields["timeout_ms"] = round(a.drain_timeout_s * 1000)
    return fields


# ---- output -----------------------------------------------------------------------------------------------

COLUMNS = ("alias", "gen", "state", "default", "active", "sha256", "package", "error")


def _row(m: dict) -> tuple[str, ...]:
    def s(v) -> str:
        return "-" if v is None or v == "" else str(v)

    default = m.get("default")
    return (s(m.get("alias")), s(m.get("generation")), s(m.get("state")),
            "-" if default is None else ("yes" if default else "no"), s(m.get("active_requests")),
            s((m.get("sha256") or "")[:12]), s(m.get("package")), s(m.get("error")))


def format_models(models: list[dict]) -> str:
    if not models:
        return "no models loaded"
    rows = [COLUMNS] + [_row(m) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_reply(op: str, reply: dict) -> str:
    if op == "models":
        return format_models(reply.get("models") or [])
    if op == "reenable-inflight":
        done = {g: chips for g, chips in (reply.get("reenabled") or {}).items() if chips}
        return ("ping/pong re-enabled: " + "; ".join(f"generation {g} chips {', '.join(map(str, c))}"
                                                     for g, c in done.items())) if done \
            else "no chip was downgraded"
    if op in ("drain", "resume"):
        if "backend" in reply:
            return f"backend {reply['backend']}: " + ("drained (no new requests; in-flight ones finish)"
                                                      if reply.get("drained") else "admitting again")
        if reply.get("accepting"):
            return "accepting new requests"
        budget = reply.get("timeout_ms")
        return ("draining: new requests get 503 draining; in-flight ones finish"
                + ("" if budget is None else f" within {budget / 1000:g} s, then are ended")
                + " (npuserve admin resume admits again)")
    if op in ("load-lora", "unload-lora"):
        ad = reply.get("adapter") or {}
        return (f"{'loaded' if op == 'load-lora' else 'unloading'} adapter {ad.get('alias', '?')} on "
                f"{ad.get('parent', '?')}: rank {ad.get('rank', '?')}, {', '.join(ad.get('targets') or [])}, "
                f"sha256 {(ad.get('sha256') or '')[:12]}, {ad.get('active_requests', 0)} running")
    m = reply.get("model") or {}
    head = {"load": "loaded", "unload": "unloaded", "replace": "replaced", "rollback": "rolled back"}[op]
    lines = [f"{head} {m.get('alias', '?')}: generation {m.get('generation', '?')} is {m.get('state', '?')}"]
    prev = reply.get("previous")
    if prev:
        lines[0] += f" (previous: generation {prev.get('generation', '?')}, {prev.get('state', '?')})"
    lines += ["", format_models([x for x in (m, prev) if x])]
    return "\n".join(lines)


def write_json(op: str, reply: dict) -> None:
    out = sys.stdout.buffer
    if op == "models":
        for m in reply.get("models") or []:
            out.write(orjson.dumps(m) + b"\n")
    else:
        out.write(orjson.dumps({"op": op, **reply}) + b"\n")


# ---- errors -----------------------------------------------------------------------------------------------

def explain(op: str, e: ClientError, endpoint: str, timeout: float) -> tuple[int, str]:
    """(exit status, message) for a failed op: 1 when the daemon refused it, 2 when it could not be asked."""
    if isinstance(e, ClientTimeout):
        still = " (the daemon may still be carrying it out: check with `npuserve admin models`)" \
            if op != "models" else ""
        return 2, (f"no reply from {endpoint} within {timeout:g} s{still}; is a daemon running there? "
                   f"(npuserve health --endpoint {endpoint}); a slow load may need a larger --timeout")
    step = e.details.get("step")
    if step:  # the daemon's message may name the op and step already ("load 'chat': verify: ...")
        return 1, f"refused: {e.message}" if f"{step}: " in e.message else f"{op} refused at step {step}: {e.message}"
    if e.code == 501:
        return 2, (f"{endpoint} does not implement `{op}` ({e.message}); a balancer leaves model management "
                   f"to its boards: run `npuserve admin --endpoint BOARD {op} ...` on each board; a daemon that "
                   f"does not serves the model it was started with: restart it with `npuserve serve --package DIR`, "
                   f"or upgrade it")
    if e.code in (401, 403):
        return 2, (f"{e.message}; admin ops need the board's ipc:// socket (its file permissions are the "
                   f"access control) or a key listed in [security] admins")
    if e.code == 400:
        return 2, f"the daemon rejected the request: {e.message}"
    return 1, f"{op} failed: {e}"


class _Progress:
    """Elapsed time on stderr (a spinner on a terminal) while a long op runs in a thread."""

    def __init__(self, label: str) -> None:
        self.label = label

    def run(self, fn):
        if not sys.stderr.isatty():
            return fn()
        from rich.console import Console

        box: dict = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                box["error"] = exc

        t = threading.Thread(target=target, name="admin-op", daemon=True)
        t0 = time.monotonic()
        with Console(stderr=True).status(self.label) as status:
            t.start()
            while t.is_alive():
                t.join(0.1)
                status.update(f"{self.label} {time.monotonic() - t0:.1f} s")
        if "error" in box:
            raise box["error"]
        return box["value"]


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    endpoint = a.endpoint or default_endpoint()
    timeout = a.timeout if a.timeout is not None else (SHORT_OP_TIMEOUT_S if a.op in SHORT_OPS else LONG_OP_TIMEOUT_S)
    fields = request_fields(a)
    label = f"{a.op} {' '.join(str(v) for v in fields.values())} ...".replace("  ", " ")
    try:
        with Client(endpoint, timeout=timeout) as client:
            reply = _Progress(label).run(lambda: client.call(a.op.replace("-", "_"), **fields))
    except ClientError as e:
        status, message = explain(a.op, e, endpoint, timeout)
        print(f"{PROG}: {message}", file=sys.stderr)
        return status
    if a.json:
        write_json(a.op, reply)
    else:
        print(format_reply(a.op, reply))
    return 0
