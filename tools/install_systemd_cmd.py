"""`npuserve install-systemd`: install the shipped units, their example configs and CURVE keys.

The units in `engine/deploy/` (`npuserve@.service` for each board,
`npuserve-balancer.service`, `npuserve-http.service`) name
`/usr/local/bin/npuserve` (where a root `pip install` puts the script); this
command writes them with `ExecStart` pointing at the `npuserve` actually
installed (the venv under /opt/npuserve, say) and the service user of your
choice, writes an example config for each (`/etc/npuserve/board-<ID>.toml`,
`balancer.toml` with one backend per `--board`, `http.toml`) unless that file
exists (never overwritten), copies key files made with `npuserve keygen` to
`/etc/npuserve/keys` and `/etc/npuserve/clients` readable by the service user
only, checks the units with `systemd-analyze verify` when systemd is there,
and prints the commands that start them. The layout is in docs/deploy.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import resources

from engine.config import ConfigError, load_config
from engine.daemon.paths import systemd_board_endpoint

SHIPPED_EXEC = "/usr/local/bin/npuserve"
UNIT_NAME = "npuserve@.service"
BALANCER_UNIT = "npuserve-balancer.service"
HTTP_UNIT = "npuserve-http.service"
UNITS = (UNIT_NAME, BALANCER_UNIT, HTTP_UNIT)
SHIPPED_USER = "npuserve"
SHIPPED_CONFIG_DIR = "/etc/npuserve"


def _shipped(name: str) -> str:
    return resources.files("engine.deploy").joinpath(name).read_text()


def shipped_unit(name: str = UNIT_NAME) -> str:
    return _shipped(name)


def shipped_board_config() -> str:
    return _shipped("board.toml")


def balancer_config(boards: list[str]) -> str:
    """The example balancer config with one [[backends]] per local board (their systemd endpoints)."""
    text = _shipped("balancer.toml")
    for board in boards:
        text += f'\n[[backends]]\nendpoint = "{systemd_board_endpoint(board)}"\n'
    return text


def render_unit(executable: str, user: str = SHIPPED_USER, config_dir: str = SHIPPED_CONFIG_DIR,
                name: str = UNIT_NAME) -> str:
    """A shipped unit with its ExecStart executable, config folder and service user replaced."""
    text = shipped_unit(name)
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
                                description="Install the board, balancer and HTTP front units, their configs "
                                            "and CURVE keys (docs/deploy.md).")
    p.add_argument("--board", action="append", default=[], metavar="ID",
                   help="a board of this host: write /etc/npuserve/board-ID.toml if missing and list it in "
                        "balancer.toml (repeatable; default 0)")
    p.add_argument("--unit-dir", default="/etc/systemd/system", help="where the units go (%(default)s)")
    p.add_argument("--config-dir", default=SHIPPED_CONFIG_DIR, help="where configs and keys go (%(default)s)")
    p.add_argument("--root", default="",
                   help="write everything under this directory (a package or image build root); the units "
                        "and configs still name the paths of the installed system")
    p.add_argument("--executable", default=None, help="the npuserve to run (default: this installation's)")
    p.add_argument("--user", default=SHIPPED_USER, help="service user (%(default)s; create it with "
                                                        "useradd --system --no-create-home npuserve)")
    p.add_argument("--key", action="append", default=[], metavar="FILE",
                   help="a key file from `npuserve keygen` (NAME.key_secret of this host's servers, NAME.key "
                        "of the servers it dials) to copy to CONFIG_DIR/keys (repeatable)")
    p.add_argument("--client-key", action="append", default=[], metavar="FILE",
                   help="a client's public NAME.key to allow: copied to CONFIG_DIR/clients (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the units instead of writing anything")
    return p.parse_args(argv)


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root else path


def _own(path: str, user: str) -> None:
    """Give `path` to the service user when we are root (secret keys must be readable by it alone)."""
    if os.geteuid() != 0:
        return
    import pwd

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        print(f"warning: no user {user!r} yet: {path} stays root's; create the user, then "
              f"chown {user}: {path}", file=sys.stderr)
        return
    os.chown(path, pw.pw_uid, pw.pw_gid)


def _write_if_missing(path: str, text: str) -> None:
    if os.path.exists(path):
        print(f"kept {path} (exists)")
        return
    with open(path, "w") as fh:
        fh.write(text)
    print(f"wrote {path}")


def _copy_key(src: str, dest_dir: str, user: str) -> None:
    os.makedirs(dest_dir, mode=0o700, exist_ok=True)
    _own(dest_dir, user)
    dest = os.path.join(dest_dir, os.path.basename(src))
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(src, "rb") as fh, os.fdopen(fd, "wb") as out:
        out.write(fh.read())
    os.chmod(dest, 0o600)
    _own(dest, user)
    print(f"wrote {dest}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    exe = os.path.abspath(args.executable or default_executable())
    config_dir = os.path.abspath(args.config_dir)
    units = {name: render_unit(exe, args.user, config_dir, name) for name in UNITS}
    if args.dry_run:
        sys.stdout.write("\n".join(f"# --- {name}\n{text}" for name, text in units.items()))
        return 0
    boards = args.board or ["0"]
    for board in boards:
        try:
            load_config(None, {"board.id": board})  # the config's own rule for board ids
        except ConfigError as e:
            print(f"npuserve install-systemd: --board {board!r}: {e.errors[0]}", file=sys.stderr)
            return 2
    for key in args.key + args.client_key:
        if not os.path.isfile(key):
            print(f"npuserve install-systemd: {key}: no such key file (make it with npuserve keygen)",
                  file=sys.stderr)
            return 2
    unit_dir, conf = _under(args.root, args.unit_dir), _under(args.root, config_dir)
    unit_paths = [os.path.join(unit_dir, name) for name in UNITS]
    try:
        os.makedirs(unit_dir, exist_ok=True)
        for path, text in zip(unit_paths, units.values()):
            with open(path, "w") as fh:
                fh.write(text)
            print(f"wrote {path} (ExecStart={exe})")
        os.makedirs(conf, exist_ok=True)
        for board in boards:
            _write_if_missing(os.path.join(conf, f"board-{board}.toml"), shipped_board_config())
        _write_if_missing(os.path.join(conf, "balancer.toml"), balancer_config(boards))
        _write_if_missing(os.path.join(conf, "http.toml"), _shipped("http.toml"))
        for key in args.key:
            _copy_key(key, os.path.join(conf, "keys"), args.user)
        for key in args.client_key:
            _copy_key(key, os.path.join(conf, "clients"), args.user)
    except PermissionError as e:
        print(f"npuserve install-systemd: {e.filename}: permission denied; run it with sudo, "
              f"or choose --unit-dir/--config-dir/--root you can write", file=sys.stderr)
        return 1
    for path in unit_paths:
        ok, out = verify(path)
        if not ok:
            print(f"npuserve install-systemd: systemd-analyze verify {path} complained:\n{out}", file=sys.stderr)
            return 1
        if out:
            print(out)
    if not os.access(exe, os.X_OK):
        print(f"warning: {exe} is not executable; pass --executable", file=sys.stderr)
    print("next:")
    print(f"  id -u {args.user} || sudo useradd --system --no-create-home {args.user}")
    print("  sudo systemctl daemon-reload")
    print(f"  sudo systemctl enable --now {' '.join(f'npuserve@{b}' for b in boards)}"
          f" npuserve-balancer npuserve-http")
    print(f"  systemctl status npuserve@{boards[0]}; journalctl -u npuserve@{boards[0]} -f")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
