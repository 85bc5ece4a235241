"""`npuserve balance`: run a balancer in front of board daemons (or other balancers).

Flags override the config file. Exit status: 0 after SIGTERM/SIGINT, 2 for a
configuration error, 1 when it cannot start (endpoint in use, unreadable
keys), 4 on an internal error. SIGHUP re-reads the file's backend list.
"""

from __future__ import annotations

import argparse
import sys

from engine.balancer.settings import POLICIES, load_settings
from engine.config_schema import ConfigError
from engine.exit_codes import EXIT_CONFIG, EXIT_STARTUP


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve balance", description="Run a balancer in front of daemons.")
    p.add_argument("--config", help="TOML file (schema = \"npuserve-balancer/v1\"); SIGHUP re-reads its backends")
    p.add_argument("--endpoint", action="append", default=[], metavar="E",
                   help="ipc:///path or tcp://host:port to listen on (repeatable; replaces balancer.endpoints)")
    p.add_argument("--backends", help="comma-separated backend endpoints (replaces [[backends]])")
    p.add_argument("--prefill", help="comma-separated prefill board endpoints (with --decode: prefill/decode "
                                     "disaggregation; beside --backends, replacing [[backends]] with them all)")
    p.add_argument("--decode", help="comma-separated decode board endpoints")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (of whole requests and prefill legs)")
    p.add_argument("--pd-min-prompt", type=int, metavar="TOKENS",
                   help="with --prefill/--decode: prompts shorter than this go whole to a decode board "
                        "(replaces routing.pd_min_prompt_tokens)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus /metrics (npuserve:balancer_*) on this port (replaces metrics.port)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    def listed(flag: str | None) -> list[str] | None:
        return [b.strip() for b in flag.split(",") if b.strip()] if flag else None

    backends, prefill, decode = listed(args.backends), listed(args.prefill), listed(args.decode)

    def load():
        return load_settings(args.config, endpoints=args.endpoint or None, backends=backends, policy=args.policy,
                             prefill=prefill, decode=decode, metrics_port=args.metrics_port,
                             pd_min_prompt=args.pd_min_prompt)

    try:
        settings = load()
    except ConfigError as e:
        print("npuserve balance: configuration error:\n  " + "\n  ".join(e.errors), file=sys.stderr)
        return EXIT_CONFIG
    import zmq

    from engine.balancer.shell import Balancer

    bal = Balancer(settings, reload=load if args.config else None)
    try:
        bal.start()
    except (ValueError, zmq.ZMQError) as e:
        bal.close()
        print(f"npuserve balance: cannot start: {e}", file=sys.stderr)
        return EXIT_STARTUP
    except BaseException:
        bal.close()
        raise
    eps = list(settings.balancer.endpoints)
    print(f"npuserve: balancer ({settings.balancer.policy}) over {len(settings.backends)} backends\n"
          f"endpoint:\n{eps[0]}\ntry:\n  npuserve health --endpoint {eps[0]}\n"
          "stop with Ctrl-C (SIGINT) or SIGTERM; SIGHUP reloads the backends", flush=True)
    return bal.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
