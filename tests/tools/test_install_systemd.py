"""The shipped systemd unit: `systemd-analyze verify`, the constraints it must keep, and the install command."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from engine.config import ServerConfig, load_config
from engine.daemon.main import overrides_from, parse_args
from tools import install_systemd_cmd as inst

ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed on this machine "
                                                           "(only this check needs it; .ci/run installs it "
                                                           "where apt-get can)")
NPUSERVE = os.path.join(os.path.dirname(sys.executable), "npuserve")


def directives(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out.append((k.strip(), v.strip()))
    return out


def test_the_shipped_unit_keeps_its_constraints():
    d = directives(inst.shipped_unit())
    keys = dict(d)
    assert keys["Type"] == "notify" and keys["NotifyAccess"] == "main"
    assert keys["KillMode"] == "mixed"  # SIGTERM to the daemon only: the workers must outlive the drain
    assert keys["RuntimeDirectory"] == "npuserve/board-%i" and keys["RuntimeDirectoryMode"] == "0700"
    assert "--runtime-dir /run/npuserve/board-%i" in keys["ExecStart"]
    assert keys["Restart"] == "on-failure" and keys["RestartPreventExitStatus"] == "2"
    assert "DeviceAllow" in keys and "PrivateDevices" not in keys
    assert "RemoveIPC" not in keys and "DynamicUser" not in keys  # both would remove /dev/shm objects
    stop_s = float(keys["TimeoutStopSec"])
    assert stop_s > ServerConfig().drain_timeout_s + 10  # drain budget plus worker stop
    assert keys["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert float(keys["WatchdogSec"]) > 0


def test_the_unit_command_line_and_example_config_start_a_valid_config():
    keys = dict(directives(inst.render_unit(NPUSERVE)))
    argv = shlex.split(keys["ExecStart"].replace("%i", "0"))
    assert argv[:2] == [NPUSERVE, "serve"]
    args = parse_args(argv[2:])
    assert args.config == "/etc/npuserve/board-0.toml"
    args.config = os.path.join(os.path.dirname(os.path.abspath(inst.__file__)), "..", "engine", "deploy", "board.toml")
    cfg = load_config(args.config, overrides_from(args))
    assert cfg.board.id == "0" and cfg.board.runtime_dir == "/run/npuserve/board-0"
    assert cfg.server.endpoints == ("ipc:///run/npuserve/board-0/board-0.sock",)
    assert cfg.log.format == "json"


@needs_systemd
def test_the_installed_unit_passes_systemd_analyze_verify(tmp_path):
    rc = inst.main(["--unit-dir", str(tmp_path / "units"), "--config-dir", str(tmp_path / "etc"),
                    "--executable", NPUSERVE, "--board", "0", "--board", "gpu-1"])
    assert rc == 0
    unit = tmp_path / "units" / "npuserve@.service"
    p = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout + p.stderr == "", p.stdout + p.stderr
    assert f"ExecStart={NPUSERVE} serve --config {tmp_path}/etc/board-%i.toml" in unit.read_text()
    assert load_config(str(tmp_path / "etc" / "board-gpu-1.toml")).schema == "npuserve/v1"


@needs_systemd
def test_verify_reports_what_systemd_only_warns_about(tmp_path):
    # systemd-analyze exits 0 on an unknown key, so the check must read its output too
    bad = tmp_path / "npuserve@.service"
    bad.write_text(inst.render_unit(NPUSERVE).replace("\nType=notify\n", "\nTpye=notify\n"))
    ok, out = inst.verify(str(bad))
    assert not ok and "Tpye" in out


def test_install_keeps_an_existing_config_and_refuses_a_bad_board(tmp_path, capsys):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "board-0.toml").write_text("# mine\n")
    assert inst.main(["--unit-dir", str(tmp_path / "u"), "--config-dir", str(etc), "--executable", NPUSERVE]) == 0
    assert (etc / "board-0.toml").read_text() == "# mine\n"
    assert "kept" in capsys.readouterr().out
    assert inst.main(["--unit-dir", str(tmp_path / "u"), "--board", "no/slash"]) == 2
    assert "board.id" in capsys.readouterr().err


def test_dry_run_prints_the_unit(capsys):
    assert inst.main(["--dry-run", "--executable", "/opt/x/npuserve", "--user", "svc"]) == 0
    out = capsys.readouterr().out
    assert "ExecStart=/opt/x/npuserve serve --config /etc/npuserve/board-%i.toml" in out
    assert "\nUser=svc\nGroup=svc\n" in out
