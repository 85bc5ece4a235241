"""Where a daemon listens when nobody says otherwise, and where the systemd units put their sockets.

`make run`, the CLI and the client library must agree on one default
endpoint without a config file; the rule is the config's own default
(`ipc://{runtime_dir}/board-{id}.sock`), computed here for clients.

Under systemd every unit has a runtime directory of its own below
`/run/npuserve` (`RuntimeDirectory=npuserve/board-%i`, `npuserve/balancer`):
systemd removes a unit's runtime directory when that unit stops, so no unit
may own a directory another one lives in. The shipped units
(`engine/deploy/*.service`) and their example configs name these paths; a
test holds them to the functions here. The layout is described once, in
docs/deploy.md.
"""

from __future__ import annotations

import os
from typing import Callable

SYSTEMD_RUNTIME_ROOT = "/run/npuserve"


def board_endpoint(runtime_dir: str, board: str) -> str:
    """The ipc:// frontend endpoint of board `board` under `runtime_dir`."""
    return f"ipc://{os.path.join(runtime_dir, f'board-{board}.sock')}"


def systemd_board_runtime_dir(board: str, root: str = SYSTEMD_RUNTIME_ROOT) -> str:
    """`npuserve@<board>.service`'s runtime directory (its `--runtime-dir`)."""
    return os.path.join(root, f"board-{board}")


def systemd_board_endpoint(board: str, root: str = SYSTEMD_RUNTIME_ROOT) -> str:
    """The ipc:// endpoint a board serves on under its systemd unit."""
    return board_endpoint(systemd_board_runtime_dir(board, root), board)


def systemd_balancer_endpoint(root: str = SYSTEMD_RUNTIME_ROOT) -> str:
    """The ipc:// endpoint `npuserve-balancer.service` listens on (beside its tcp:// one, if any)."""
    return f"ipc://{os.path.join(root, 'balancer', 'balancer.sock')}"


def default_endpoint(board: str = "0", exists: Callable[[str], bool] = os.path.exists) -> str:
    """This user's own board socket; if there is none but a systemd board's socket is there, that one.

    A foreground `npuserve serve` and `make run` listen under the user's
    runtime directory; a board under systemd under /run/npuserve. The CLI run
    as the service user (or root) next to a systemd board thus finds it
    without `--endpoint`.
    """
    from engine.config import default_runtime_dir

    own = board_endpoint(default_runtime_dir(), board)
    system = systemd_board_endpoint(board)
    if not exists(own[len("ipc://"):]) and exists(system[len("ipc://"):]):
        return system
    return own
