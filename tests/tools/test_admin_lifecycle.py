"""`npuserve admin` and `npuserve golden` against a real daemon that loads, replaces and unloads models."""

from __future__ import annotations

import shutil

import orjson
import pytest

from test_cli_commands import npuserve
from workers.default_package import ensure_default_package
from workers.model_maker import make_model


@pytest.mark.integration
def test_admin_load_golden_replace_rollback_unload_against_a_real_daemon(daemon, tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(ensure_default_package(), root / "tiny")
    make_model(str(root / "small"), vocab=320, layers=1, d_model=16, heads=2, kv_heads=1, golden_cases=2,
               golden_max_tokens=4, max_seq=128, kv_num_blocks=64, name="small")
    shutil.copytree(root / "small", root / "bad")
    with open(root / "bad" / "weights.npz", "ab") as f:
        f.write(b"x")
    d = daemon(backend="ref", chips=1, extra=["--model-root", str(root), "--model", "tiny=tiny"])
    e = d.endpoint

    r = npuserve("admin", "--endpoint", e, "load", "small", "small", "--json")
    assert r.returncode == 0, r.stderr
    entry = orjson.loads(r.stdout)["model"]
    assert (entry["alias"], entry["state"], entry["package"]) == ("small", "ready", "small")

    r = npuserve("admin", "--endpoint", e, "load", "small", "tiny")
    assert r.returncode == 1 and "409 already_loaded" in r.stderr, r.stderr  # a conflict, not a 500

    r = npuserve("admin", "--endpoint", e, "load", "bad", "bad")
    assert r.returncode == 1 and "refused:" in r.stderr and "verify" in r.stderr
    assert "weights.npz: sha256 does not match the manifest" in r.stderr
    r = npuserve("admin", "--endpoint", e, "load", "esc", "../tiny")
    assert r.returncode == 1 and "resolve" in r.stderr and "'..'" in r.stderr

    r = npuserve("golden", "--endpoint", e, "--package", str(root / "small"), "--model", "small")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "ok: 2/2 golden cases passed", r.stdout + r.stderr

    r = npuserve("admin", "--endpoint", e, "replace", "small", "tiny", "--json")
    assert r.returncode == 0, r.stderr
    body = orjson.loads(r.stdout)
    assert body["model"]["package"] == "tiny" and body["previous"]["package"] == "small"
    r = npuserve("golden", "--endpoint", e, "--package", str(root / "tiny"), "--model", "small")
    assert r.returncode == 0, r.stdout + r.stderr  # the alias now serves tiny's outputs

    r = npuserve("admin", "--endpoint", e, "rollback", "small")
    assert r.returncode == 0 and r.stdout.startswith("rolled back small: generation"), r.stderr
    r = npuserve("golden", "--endpoint", e, "--package", str(root / "small"), "--model", "small")
    assert r.returncode == 0, r.stdout + r.stderr

    r = npuserve("admin", "--endpoint", e, "unload", "small", "--deadline", "5")
    assert r.returncode == 0 and r.stdout.startswith("unloaded small: generation") and "is unloaded" in r.stdout
    r = npuserve("admin", "--endpoint", e, "models", "--json")
    ready = [m for m in map(orjson.loads, r.stdout.splitlines()) if m["state"] == "ready"]
    assert [m["alias"] for m in ready] == ["tiny"]
    r = npuserve("admin", "--endpoint", e, "rollback", "small")
    assert r.returncode == 1 and "404 model_not_found" in r.stderr
