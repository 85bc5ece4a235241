"""The plumbing of the one-reply CLI queries (`npuserve health`, `npuserve stats`).

Both ask a daemon one question and print the reply the same way: the same
`--endpoint/--timeout/--json` options, exit 2 when the daemon cannot be
asked, the raw reply with `--json`, otherwise a human-readable rendering.
Only the question, the rendering and the verdict differ.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import orjson

from engine.client import Client, default_endpoint
from engine.errors import ClientError


def run_query(argv: list[str], *, name: str, description: str, ask: Callable[[Client], dict],
              render: Callable[[dict], str], verdict: Callable[[dict], int]) -> int:
    """Parse argv, send `ask(client)`, print the reply; returns 2 on a client error, else `verdict(reply)`."""
    p = argparse.ArgumentParser(prog=f"npuserve {name}", description=description)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        with Client(a.endpoint or default_endpoint(), timeout=a.timeout) as c:
            reply = ask(c)
    except ClientError as e:
        print(f"npuserve {name}: {e}", file=sys.stderr)
        return 2
    if a.json:
        sys.stdout.buffer.write(orjson.dumps(reply) + b"\n")
    else:
        print(render(reply))
    return verdict(reply)
