"""Model packages: verification, make-model, check-package, the default tiny package."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tools import check_package as check_cmd
from tools import make_model_cmd
from workers import model_maker
from workers.default_package import default_model_params, default_package_dir, ensure_default_package
from workers.package_loader import load_package
from workers.package_manifest import PackageError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return model_maker.make_model(str(tmp_path_factory.mktemp("pkg") / "m"), max_seq=128, kv_num_blocks=32, seed=5)


@pytest.fixture
def pkg_dir(pristine, tmp_path):
    """A private copy of the package that a test may damage."""
    dst = tmp_path / "copy"
    dst.mkdir()
    for name in os.listdir(pristine):
        (dst / name).write_bytes((open(os.path.join(pristine, name), "rb")).read())
    return str(dst)


def _rewrite_manifest(pkg_dir: str, **changes) -> None:
    path = os.path.join(pkg_dir, "manifest.json")
    m = json.load(open(path))
    m.update(changes)
    with open(path, "w") as f:
        json.dump(m, f)


def _rehash(pkg_dir: str, name: str) -> None:
    digest = hashlib.sha256(open(os.path.join(pkg_dir, name), "rb").read()).hexdigest()
    path = os.path.join(pkg_dir, "manifest.json")
    m = json.load(open(path))
    m["files"][name] = digest
    with open(path, "w") as f:
        json.dump(m, f)


def test_a_made_package_loads_and_is_identified_by_its_manifest_hash(pkg_dir):
    pkg = load_package(pkg_dir)
    assert pkg.sha256 == hashlib.sha256(open(os.path.join(pkg_dir, "manifest.json"), "rb").read()).hexdigest()
    assert pkg.manifest["schema"] == "npuserve-model/v1"
    assert pkg.profiles == [1, 4, 8, 16] and pkg.block_size == 16
    assert (pkg.vocab_size, pkg.bos_id, pkg.eos_ids) == (320, 256, (257,))
    assert (pkg.layers, pkg.d_model, pkg.heads, pkg.kv_heads, pkg.head_dim) == (2, 64, 4, 2, 16)
    w = pkg.weights()
    assert w["embed"].shape == (320, 64) and w["layers.1.wk"].shape == (64, 32)
    cases = pkg.golden()
    assert len(cases) == 4 and all(len(c["tokens"]) == c["max_tokens"] for c in cases)
    assert len({tuple(c["tokens"]) for c in cases}) == 4  # greedy output is not one constant sequence


def test_tampered_weights_fail_naming_the_file(pkg_dir):
    path = os.path.join(pkg_dir, "weights.npz")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(PackageError, match=r"weights\.npz.*sha256"):
        load_package(pkg_dir)


def test_weights_changed_after_loading_are_refused(pkg_dir):
    pkg = load_package(pkg_dir)
    np.savez(os.path.join(pkg_dir, "weights.npz"), **{k: v * 2 for k, v in pkg.weights().items()})
    with pytest.raises(PackageError, match=r"weights\.npz"):
        pkg.weights()


def test_missing_file_fails_naming_it(pkg_dir):
    os.unlink(os.path.join(pkg_dir, "golden.json"))
    with pytest.raises(PackageError, match=r"golden\.json: missing"):
        load_package(pkg_dir)


def test_extra_file_fails_naming_it(pkg_dir):
    open(os.path.join(pkg_dir, "notes.txt"), "w").write("hi")
    with pytest.raises(PackageError, match=r"notes\.txt: file not listed"):
        load_package(pkg_dir)


@pytest.mark.parametrize("changes,pattern", [
    ({"schema": "npuserve-model/v0"}, "unsupported schema"),
    ({"architecture": "mamba"}, "unsupported architecture"),
    ({"eos_ids": [999]}, "eos_ids"),
    ({"profiles": []}, "profiles"),
    ({"dims": {"layers": 2}}, "bad dims"),
    ({"files": {"weights.npz": "0" * 64, "../golden.json": "0" * 64}}, "invalid file name"),
])
def test_bad_manifest_fails_naming_the_manifest(pkg_dir, changes, pattern):
    _rewrite_manifest(pkg_dir, **changes)
    with pytest.raises(PackageError, match=rf"manifest\.json: .*{pattern}"):
        load_package(pkg_dir)


def test_unreadable_manifest_and_wrong_tensor_shapes(pkg_dir):
    pkg = load_package(pkg_dir)
    weights = pkg.weights()
    weights["embed"] = weights["embed"][:, :32]
    np.savez(os.path.join(pkg_dir, "weights.npz"), **weights)
    _rehash(pkg_dir, "weights.npz")  # hashes agree, content does not fit the dims
    with pytest.raises(PackageError, match=r"weights\.npz: tensor 'embed' has shape"):
        load_package(pkg_dir).weights()
    open(os.path.join(pkg_dir, "manifest.json"), "w").write("{not json")
    with pytest.raises(PackageError, match=r"manifest\.json: not valid JSON"):
        load_package(pkg_dir)


def test_check_package_passes_the_golden_cases(pkg_dir, capsys):
    assert check_cmd.main([pkg_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"ok": True, "cases": 4, "passed": 4, "error": None}


def test_check_package_reports_a_tampered_package(pkg_dir, capsys):
    os.unlink(os.path.join(pkg_dir, "weights.npz"))
    assert check_cmd.main([pkg_dir, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["passed"] == 0
    assert "weights.npz" in report["error"]


def test_check_package_catches_wrong_golden_tokens(pkg_dir, capsys):
    gpath = os.path.join(pkg_dir, "golden.json")
    cases = json.load(open(gpath))
    cases[1]["tokens"][3] = (cases[1]["tokens"][3] + 1) % 256
    json.dump(cases, open(gpath, "w"))
    _rehash(pkg_dir, "golden.json")  # a consistent package whose golden tokens are wrong
    assert check_cmd.main([pkg_dir, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["cases"] == 4 and report["passed"] == 3
    assert "case1" in report["error"]


def test_check_package_catches_weights_that_disagree_with_golden(pkg_dir, capsys):
    pkg = load_package(pkg_dir)
    weights = pkg.weights()
    weights["lm_head"] = np.roll(weights["lm_head"], 1, axis=1)  # every token id shifted by one
    np.savez(os.path.join(pkg_dir, "weights.npz"), **weights)
    _rehash(pkg_dir, "weights.npz")
    assert check_cmd.main([pkg_dir]) == 1
    assert "FAILED: 0/4" in capsys.readouterr().err


def test_make_model_cli_writes_the_requested_dims(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = make_model_cmd.main(["--out", str(out), "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
                           "--vocab", "300", "--seed", "3", "--profiles", "1,2", "--golden-cases", "2", "--max-seq", "64",
                           "--kv-blocks", "8", "--tied"])
    assert rc == 0 and capsys.readouterr().out.strip() == str(out)
    pkg = load_package(str(out))
    assert (pkg.layers, pkg.d_model, pkg.heads, pkg.kv_heads, pkg.vocab_size) == (1, 32, 2, 1, 300)
    assert pkg.dims.tie_embeddings and pkg.profiles == [1, 2] and pkg.kv_num_blocks == 8
    assert len(pkg.golden()) == 2
    assert check_cmd.check_package(str(out)).ok
    # A second run must not overwrite an existing package.
    assert make_model_cmd.main(["--out", str(out)]) == 1
    assert load_package(str(out)).sha256 == pkg.sha256


def test_same_parameters_give_the_same_package(tmp_path):
    a = load_package(model_maker.make_model(str(tmp_path / "a"), seed=9, max_seq=64, golden_cases=1))
    b = load_package(model_maker.make_model(str(tmp_path / "b"), seed=9, max_seq=64, golden_cases=1))
    c = load_package(model_maker.make_model(str(tmp_path / "c"), seed=10, max_seq=64, golden_cases=1))
    assert a.manifest["files"] == b.manifest["files"]
    assert a.manifest["files"]["weights.npz"] != c.manifest["files"]["weights.npz"]


def test_default_params_describe_a_byte_level_tiny_model():
    p = default_model_params()
    assert p["vocab"] >= 259 and p["profiles"] == [1, 4, 8, 16] and p["block_size"] == 16
    assert 1024 <= p["max_seq"] <= 2048 and 512 <= p["kv_num_blocks"] <= 2048


def test_default_package_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("NPUSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_package_dir().startswith(str(tmp_path / "xdg" / "npuserve" / "models" / "tiny-"))
    monkeypatch.setenv("NPUSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert default_package_dir().startswith(str(tmp_path / "c" / "models" / "tiny-"))


def test_ensure_default_package_builds_once(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_default_package()
    assert path == default_package_dir()
    pkg = load_package(path)
    assert pkg.vocab_size == default_model_params()["vocab"]
    inode = os.stat(os.path.join(path, "manifest.json")).st_ino
    assert ensure_default_package() == path
    assert os.stat(os.path.join(path, "manifest.json")).st_ino == inode


def test_ensure_default_package_is_safe_when_processes_race(tmp_path):
    env = dict(os.environ, NPUSERVE_CACHE_DIR=str(tmp_path))
    code = "from workers.default_package import ensure_default_package as e; print(e())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1
    assert load_package(outs[0]).sha256
    assert os.listdir(os.path.dirname(outs[0])) == [os.path.basename(outs[0])]  # no temp dirs left
