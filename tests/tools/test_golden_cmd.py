"""`npuserve golden` against a real daemon serving the tiny model: its cases pass; altered golden tokens fail."""

from __future__ import annotations

import json
import shutil

import orjson
import pytest

from test_cli_commands import npuserve
from workers.default_package import ensure_default_package
from workers.package_loader import load_package
from workers.package_manifest import write_manifest


@pytest.fixture(scope="module")
def tiny_package():
    return ensure_default_package()


@pytest.fixture
def altered_package(tiny_package, tmp_path):
    """The tiny package with case1's third golden token changed, re-pinned by the package's manifest writer."""
    out = tmp_path / "altered"
    shutil.copytree(tiny_package, out)
    cases = json.loads((out / "golden.json").read_text())
    cases[1]["tokens"][2] = (cases[1]["tokens"][2] + 1) % 256
    (out / "golden.json").write_text(json.dumps(cases))
    write_manifest(str(out), json.loads((out / "manifest.json").read_text()))
    load_package(str(out))  # a valid package: every hash matches
    return str(out), cases[1]["tokens"][2]


@pytest.mark.integration
def test_golden_passes_and_altered_tokens_fail(daemon, tiny_package, altered_package):
    d = daemon(backend="ref", chips=1)
    r = npuserve("golden", "--endpoint", d.endpoint, "--package", tiny_package)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["case", "status", "tokens", "reason"]
    assert [ln.split()[:3] for ln in lines[1:5]] == [[f"case{i}", "PASS", "8/8"] for i in range(4)]
    assert lines[-1] == "ok: 4/4 golden cases passed"
    assert "note:" not in r.stderr  # the daemon serves this very package

    r = npuserve("golden", "--endpoint", d.endpoint, "--package", tiny_package, "--model", "tiny", "--json")
    assert r.returncode == 0, r.stderr
    objs = [orjson.loads(ln) for ln in r.stdout.splitlines()]
    assert [o["status"] for o in objs[:4]] == ["pass"] * 4 and all(o["got"] == o["expected"] for o in objs[:4])
    assert objs[4]["ok"] is True and objs[4]["passed"] == 4 and objs[4]["model"] == "tiny"

    path, wrong = altered_package
    r = npuserve("golden", "--endpoint", d.endpoint, "--package", path, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    objs = [orjson.loads(ln) for ln in r.stdout.splitlines()]
    assert [o["status"] for o in objs[:4]] == ["pass", "fail", "pass", "pass"]
    assert objs[1]["reason"].startswith(f"token 2: expected {wrong}, got ")
    assert objs[4] == {**objs[4], "ok": False, "passed": 3, "failed": 1}
    assert "the server's model has sha256" in r.stderr  # another package than the one served
    r = npuserve("golden", "--endpoint", d.endpoint, "--package", path)
    assert r.returncode == 1 and "FAIL" in r.stdout and r.stdout.splitlines()[-1].startswith("FAILED: 3/4")


@pytest.mark.integration
def test_golden_errors_say_what_to_do(daemon, tiny_package, tmp_path):
    d = daemon(backend="ref", chips=1)
    r = npuserve("golden", "--endpoint", d.endpoint, "--package", tiny_package, "--model", "other")
    assert r.returncode == 2 and "model 'other' is not served here" in r.stderr
    assert f"npuserve admin --endpoint {d.endpoint} models" in r.stderr
    r = npuserve("golden", "--endpoint", d.endpoint, "--package", str(tmp_path / "none"))
    assert r.returncode == 2 and "not a model package directory" in r.stderr and "check-package" in r.stderr
    nobody = f"ipc://{tmp_path}/nobody.sock"
    r = npuserve("golden", "--endpoint", nobody, "--package", tiny_package, "--timeout", "0.5")
    assert r.returncode == 2 and "no answer from" in r.stderr and "npuserve health --endpoint" in r.stderr
