"""`npuserve install-systemd`: install the shipped template unit and an example board config.

The unit in `engine/deploy/npuserve@.service` names `/usr/local/bin/npuserve`
(where a root `pip install` puts the script); this command writes it with
`ExecStart` pointing at the `npuserve` actually installed (a virtualenv's,
say) and the service user of your choice, copies the example config to
`/etc/npuserve/board-<ID>.toml` unless that file exists (never overwritten),
checks the result with `systemd-analyze verify` when systemd is there, and
prints the commands that start it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import resources

from engine.config import ConfigError, load_config

SHIPPED_EXEC = "/usr/local/bin/npuserve"
UNIT_NAME = "npuserve@.service"
SHIPPED_USER = "npuserve"
SHIPPED_CONFIG_DIR = "/etc/npuserve"


def shipped_unit() -> str:
    return resources.files("engine.deploy").joinpath(UNIT_NAME).read_text()


def shipped_board_config() -> str:
    return resources.files("engine.deploy").joinpath("board.toml").read_text()


def render_unit(executable: str, user: str = SHIPPED_USER, config_dir: str = SHIPPED_CONFIG_DIR) -> str:
    """The shipped unit with its ExecStart executable, config folder and service user replaced."""
    text = shipped_unit()
    assert f"ExecStart={SHIPPED_EXEC} " in text and f"\nUser={SHIPPED_USER}\n" in text
    text = text.replace(f"ExecStart={SHIPPED_EXEC} ", f"ExecStart={executable} ")
    text = text.replace(f"--config {SHIPPED_CONFIG_DIR}/", f"--config {config_dir.rstrip('/')}/")
    text = text.replace(f"\nUser={SHIPPED_USER}\n", f"\nUser={user}\n")
    return text.replace(f"\nGroup={SHIPPED_USER}\n", f"\nGroup={user}\n")


def default_executable() -> str:
    """The npuserve script next to this Python (a venv's bin/), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "npuserve")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("npuserve") or SHIPPED_EXEC


def verify(unit_path: str) -> tuple[bool, str]:
    """`systemd-analyze verify` on the unit: ok only with exit 0 and no complaint about this file."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        return True, "systemd-analyze not found: not verified"
    p = subprocess.run([tool, "verify", unit_path], capture_output=True, text=True, timeout=60)
    out = (p.stdout + p.stderr).strip()
    # verify exits 0 on an unknown key or a bad value (it only warns), so any line about the file counts.
    base = os.path.basename(unit_path).replace("@.service", "@")
    complaints = [ln for ln in out.splitlines() if unit_path in ln or base in ln]
    return p.returncode == 0 and not complaints, out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve install-systemd",
                                description="Install the npuserve@.service template unit and a board config.")
    p.add_argument("--board", action="append", default=[], metavar="ID",
                   help="write /etc/npuserve/board-ID.toml for this board if missing (repeatable; default 0)")
    p.add_argument("--unit-dir", default="/etc/systemd/system", help="where the unit goes (%(default)s)")
    p.add_argument("--config-dir", default=SHIPPED_CONFIG_DIR, help="where board configs go (%(default)s)")
    p.add_argument("--executable", default=None, help="the npuserve to run (default: this installation's)")
    p.add_argument("--user", default=SHIPPED_USER, help="service user (%(default)s; create it with "
                                                        "useradd --system --no-create-home npuserve)")
    p.add_argument("--dry-run", action="store_true", help="print the unit instead of writing anything")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    exe = os.path.abspath(args.executable or default_executable())
    config_dir = os.path.abspath(args.config_dir)
    unit = render_unit(exe, args.user, config_dir)
    if args.dry_run:
        sys.stdout.write(unit)
        return 0
    boards = args.board or ["0"]
    for board in boards:
        try:
            load_config(None, {"board.id": board})  # the config's own rule for board ids
        except ConfigError as e:
            print(f"npuserve install-systemd: --board {board!r}: {e.errors[0]}", file=sys.stderr)
            return 2
    try:
        os.makedirs(args.unit_dir, exist_ok=True)
        unit_path = os.path.join(args.unit_dir, UNIT_NAME)
        with open(unit_path, "w") as fh:
            fh.write(unit)
        print(f"wrote {unit_path} (ExecStart={exe})")
        os.makedirs(config_dir, exist_ok=True)
        for board in boards:
            config_path = os.path.join(config_dir, f"board-{board}.toml")
            if os.path.exists(config_path):
                print(f"kept {config_path} (exists)")
                continue
            with open(config_path, "w") as fh:
                fh.write(shipped_board_config())
            print(f"wrote {config_path}")
    except PermissionError as e:
        print(f"npuserve install-systemd: {e.filename}: permission denied; run it with sudo, "
              f"or choose --unit-dir/--config-dir you can write", file=sys.stderr)
        return 1
    ok, out = verify(unit_path)
    if not ok:
        print(f"npuserve install-systemd: systemd-analyze verify {unit_path} complained:\n{out}", file=sys.stderr)
        return 1
    if out:
        print(out)
    if not os.access(exe, os.X_OK):
        print(f"warning: {exe} is not executable; pass --executable", file=sys.stderr)
    print("next:")
    print(f"  id -u {args.user} || sudo useradd --system --no-create-home {args.user}")
    print("  sudo systemctl daemon-reload")
    for board in boards:
        print(f"  sudo systemctl enable --now npuserve@{board}")
    print(f"  systemctl status npuserve@{boards[0]}; journalctl -u npuserve@{boards[0]} -f")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
