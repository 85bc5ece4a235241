"""Where a daemon listens when nobody says otherwise.

`make run`, the CLI and the client library must agree on one default
endpoint without a config file; the rule is the config's own default
(`ipc://{runtime_dir}/board-{id}.sock`), computed here for clients.
"""

from __future__ import annotations

import os


def board_endpoint(runtime_dir: str, board: str) -> str:
    """The ipc:// frontend endpoint of board `board` under `runtime_dir`."""
    return f"ipc://{os.path.join(runtime_dir, f'board-{board}.sock')}"


def default_endpoint(board: str = "0") -> str:
    from engine.config import default_runtime_dir

    return board_endpoint(default_runtime_dir(), board)
