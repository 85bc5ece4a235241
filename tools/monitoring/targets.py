"""What Prometheus scrapes: boards, balancers and HTTP fronts, each with the labels an operator filters by.

Every target carries `role` (board | balancer | front) and `host`; a board
also carries `board` (its id). The rules select board series by
`role="board"`, so a front that re-exports its upstream's series (a front
dialling a board directly) is never counted twice.

Addresses follow the deployment of docs/deploy.md on one host unless given:
board N's /metrics on 127.0.0.1:(9400 + N) (`metrics.port` in
board-N.toml), the balancer's on 127.0.0.1:9390 (`metrics.port` in
balancer.toml), the front's on its listen address 127.0.0.1:8000.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BOARD_BASE_PORT = 9400
BALANCER_PORT = 9390
HTTP_PORT = 8000
LOCAL = "127.0.0.1"
ROLES = ("board", "balancer", "front")
JOBS = {"board": "npuserve-board", "balancer": "npuserve-balancer", "front": "npuserve-http"}
_ADDR_RE = re.compile(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9._-]+):(\d{1,5})\Z")
_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")


class TargetError(ValueError):
    """A target the command line names that Prometheus could not scrape."""


@dataclass(frozen=True)
class Target:
    role: str
    address: str  # host:port of its /metrics
    host: str  # the `host` label
    board: str | None = None  # the `board` label (boards only)

    def labels(self) -> dict[str, str]:
        out = {"role": self.role, "host": self.host}
        if self.board is not None:
            out["board"] = self.board
        return out


def _address(text: str, what: str) -> tuple[str, int]:
    m = _ADDR_RE.match(text)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise TargetError(f"{what}: {text!r} is not HOST:PORT (a port 1..65535)")
    return m.group(1), int(m.group(2))


def _host_label(host: str, local_name: str) -> str:
    return local_name if host in (LOCAL, "localhost", "[::1]") else host.strip("[]")


def parse_boards(spec: str | None, local_name: str) -> list[Target]:
    """`--boards`: comma-separated `N` (board N here, port 9400+N), `ID=HOST:PORT`, or `HOST:PORT` (the board
    label is then HOST:PORT). None: board 0 here."""
    out = []
    for item in [s.strip() for s in (spec or "0").split(",") if s.strip()]:
        if item.isdigit():
            port = BOARD_BASE_PORT + int(item)
            if port > 65535:
                raise TargetError(f"--boards: board {item} has no default port (9400 + N); give ID=HOST:PORT")
            out.append(Target("board", f"{LOCAL}:{port}", local_name, item))
            continue
        board, _, addr = item.rpartition("=")
        host, port = _address(addr, "--boards")
        if board and not _ID_RE.match(board):
            raise TargetError(f"--boards: {board!r} is not a board id (letters, digits, . _ -)")
        out.append(Target("board", f"{host}:{port}", _host_label(host, local_name), board or f"{host}:{port}"))
    _unique(out, "--boards")
    return out


def parse_addresses(spec: str | None, role: str, default_port: int, local_name: str, flag: str) -> list[Target]:
    """`--balancer` / `--http`: comma-separated HOST:PORT (None: the local default; "" or "none": none)."""
    if spec is None:
        return [Target(role, f"{LOCAL}:{default_port}", local_name)]
    if spec.strip() in ("", "none"):
        return []
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        host, port = _address(item, flag)
        out.append(Target(role, f"{host}:{port}", _host_label(host, local_name)))
    _unique(out, flag)
    return out


def _unique(targets: list[Target], flag: str) -> None:
    seen: set[str] = set()
    for t in targets:
        if t.address in seen:
            raise TargetError(f"{flag}: {t.address} is listed twice")
        seen.add(t.address)
