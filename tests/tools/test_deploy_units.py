"""The shipped deployment fits together: two boards, a balancer and the HTTP front as `install-systemd` writes them.

The units are rendered into a temporary root, checked with `systemd-analyze
verify`, held to the one layout of `engine/daemon/paths.py`, and then their
exact `ExecStart=` command lines are run (as this user, with /etc/npuserve and
/run/npuserve pointed at the temporary root, the runtime directories made as
systemd makes them) and a request goes front -> balancer -> board.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request

import pytest

from repo_root import ROOT
from tools.load.ports import free_port
from waiting import read_log, wait_until
from engine.balancer.settings import load_settings
from engine.config import load_config
from engine.daemon import paths
from tools import install_systemd_cmd as inst

ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed on this machine "
                                                           "(.ci/run installs it where apt-get can)")
NPUSERVE = os.path.join(os.path.dirname(sys.executable), "npuserve")
BOARDS = [f"t{os.getpid() % 100000}a", f"t{os.getpid() % 100000}b"]  # unique: shared memory is named by board


def directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


@pytest.fixture
def root():
    d = tempfile.mkdtemp(prefix="npd-", dir="/tmp")  # short: ipc paths <= 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def install(root: str) -> dict[str, dict[str, str]]:
    argv = ["--root", root, "--executable", NPUSERVE]
    for b in BOARDS:
        argv += ["--board", b]
    assert inst.main(argv) == 0
    units = os.path.join(root, "etc/systemd/system")
    return {name: directives(open(os.path.join(units, name)).read()) for name in inst.UNITS}


def test_every_unit_has_a_runtime_directory_of_its_own_and_the_configs_name_its_sockets(root):
    units = install(root)
    board, bal, http = (units[n] for n in inst.UNITS)
    # systemd removes a unit's RuntimeDirectory when it stops: none may contain another's
    dirs = [board["RuntimeDirectory"].replace("%i", b) for b in BOARDS] + [bal["RuntimeDirectory"]]
    for a in dirs:
        for b in dirs:
            assert a == b or not (b + "/").startswith(a + "/"), (a, b)
    assert "RuntimeDirectory" not in http  # the front needs none
    assert board["RuntimeDirectoryMode"] == bal["RuntimeDirectoryMode"] == "0700"  # socket 0600 in a 0700 dir
    for b in BOARDS:
        rt = "/run/" + board["RuntimeDirectory"].replace("%i", b)
        assert rt == paths.systemd_board_runtime_dir(b)
        argv = shlex.split(board["ExecStart"].replace("%i", b))
        assert argv[argv.index("--runtime-dir") + 1] == rt
        from engine.daemon.main import overrides_from, parse_args

        args = parse_args(argv[2:])
        cfg = load_config(args.config.replace("/etc/", f"{root}/etc/"), overrides_from(args))
        assert cfg.server.endpoints == (paths.systemd_board_endpoint(b),)
    conf = os.path.join(root, "etc/npuserve")
    s = load_settings(os.path.join(conf, "balancer.toml"))
    assert s.balancer.endpoints == (paths.systemd_balancer_endpoint(),)
    assert os.path.dirname(paths.systemd_balancer_endpoint()[len("ipc://"):]) == "/run/" + bal["RuntimeDirectory"]
    assert [x.endpoint for x in s.backends] == [paths.systemd_board_endpoint(b) for b in BOARDS]
    assert load_config(os.path.join(conf, "http.toml")).http.upstream == paths.systemd_balancer_endpoint()


@needs_systemd
def test_the_units_for_two_boards_a_balancer_and_a_front_pass_systemd_analyze_verify(root):
    install(root)
    units = os.path.join(root, "etc/systemd/system")
    for name in inst.UNITS:
        p = subprocess.run([ANALYZE, "verify", os.path.join(units, name)], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0 and p.stdout + p.stderr == "", (name, p.stdout + p.stderr)


def test_the_cli_default_endpoint_finds_a_systemd_board_when_the_user_has_none():
    system = paths.systemd_board_endpoint("0")[len("ipc://"):]
    assert paths.default_endpoint("0", exists=lambda p: p == system) == "ipc://" + system
    own = paths.default_endpoint("0", exists=lambda p: False)
    assert own != "ipc://" + system and own.endswith("/board-0.sock")  # nothing running: the user's own
    assert paths.default_endpoint("0", exists=lambda p: True) == own  # the user's own board comes first


def _point_at(text: str, root: str) -> str:
    return text.replace("/etc/npuserve", f"{root}/etc/npuserve").replace("/run/npuserve", f"{root}/run/npuserve")


def _make_runtime_dir(unit: dict[str, str], root: str, instance: str = "") -> None:
    """What systemd does before ExecStart=: RuntimeDirectory= made with RuntimeDirectoryMode=."""
    if "RuntimeDirectory" in unit:
        d = os.path.join(root, "run", unit["RuntimeDirectory"].replace("%i", instance))
        os.makedirs(d, exist_ok=True)
        os.chmod(d, int(unit["RuntimeDirectoryMode"], 8))


def test_the_exec_start_lines_serve_a_request_front_to_balancer_to_board(root):
    units = install(root)
    conf = os.path.join(root, "etc/npuserve")
    for name in [f"board-{b}.toml" for b in BOARDS] + ["balancer.toml", "http.toml"]:
        path = os.path.join(conf, name)
        text = _point_at(open(path).read(), root)
        if name.startswith("board-"):  # fast and model-free: the stub backend on one chip
            text = text.replace('backend = "ref"', 'backend = "stub"').replace("chips = 2", "chips = 1")
        port = free_port()
        text = text.replace('listen = "127.0.0.1:8000"', f'listen = "127.0.0.1:{port}"') if name == "http.toml" \
            else text
        open(path, "w").write(text)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("NOTIFY_SOCKET", None)
    plan = [(units[inst.UNIT_NAME], b) for b in BOARDS] + [(units[inst.BALANCER_UNIT], ""),
                                                          (units[inst.HTTP_UNIT], "")]
    procs: list[tuple[str, subprocess.Popen, str]] = []
    try:
        for unit, instance in plan:
            _make_runtime_dir(unit, root, instance)
            argv = shlex.split(_point_at(unit["ExecStart"].replace("%i", instance), root))
            assert argv[0] == NPUSERVE
            log_path = os.path.join(root, f"{argv[1]}{instance}.log")
            with open(log_path, "wb") as log:
                procs.append((log_path, subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                         stdin=subprocess.DEVNULL, cwd=root), " ".join(argv)))
        url = f"http://127.0.0.1:{port}"

        def logs() -> str:
            return "\n".join(f"--- {cmd} (rc {p.poll()})\n{read_log(lp)[-1500:]}" for lp, p, cmd in procs)

        def front_up() -> bool:
            assert all(p.poll() is None for _, p, _ in procs), logs()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(front_up, timeout=90, interval=0.1, what=f"the front's /health 200\n{logs()}")
        from engine.client import Client

        with Client(paths.systemd_balancer_endpoint(f"{root}/run/npuserve"), timeout=5) as c:
            wait_until(lambda: c.health().get("backends_up") == len(BOARDS), timeout=60, interval=0.1,
                       what="both boards up at the balancer")
        for _ in range(4):
            req = urllib.request.Request(url + "/v1/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3,
                                                          "temperature": 0}).encode())
            with urllib.request.urlopen(req, timeout=30) as r:
                body = json.loads(r.read())
            assert body["usage"]["completion_tokens"] == 3, body
        with Client(paths.systemd_balancer_endpoint(f"{root}/run/npuserve"), timeout=5) as c:
            routed = c.stats()["balancer"]["routed"]
        assert sum(routed.values()) == 4 and set(routed) <= {paths.systemd_board_endpoint(b, f"{root}/run/npuserve")
                                                             for b in BOARDS}, routed
        for b in BOARDS:  # every hop answers health where deploy.md says it listens
            with Client(paths.systemd_board_endpoint(b, f"{root}/run/npuserve"), timeout=5) as c:
                assert c.health()["chips_up"] == 1
    finally:
        for _, p, _ in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        rcs = []
        for lp, p, cmd in reversed(procs):
            try:
                rcs.append(p.wait(30))
            except subprocess.TimeoutExpired:
                p.kill()
                rcs.append(p.wait())
    assert rcs == [0] * len(procs), logs()


def test_keys_from_keygen_are_installed_private_to_the_service_user(root, tmp_path):
    from tools import keygen_cmd

    assert keygen_cmd.main([str(tmp_path / "k"), "board-a0"]) == 0
    assert keygen_cmd.main([str(tmp_path / "k"), "balancer-a-client"]) == 0
    assert inst.main(["--root", root, "--executable", NPUSERVE, "--key", str(tmp_path / "k/board-a0.key_secret"),
                      "--client-key", str(tmp_path / "k/balancer-a-client.key")]) == 0
    conf = os.path.join(root, "etc/npuserve")
    for p in ("keys", "keys/board-a0.key_secret", "clients", "clients/balancer-a-client.key"):
        mode = os.stat(os.path.join(conf, p)).st_mode & 0o777
        assert mode == (0o700 if "." not in p else 0o600), (p, oct(mode))
    assert open(os.path.join(conf, "keys/board-a0.key_secret")).read() == \
        open(tmp_path / "k/board-a0.key_secret").read()
    assert inst.main(["--root", root, "--key", str(tmp_path / "missing.key")]) == 2
