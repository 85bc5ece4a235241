"""`npuserve keygen --signing` and `npuserve sign-package`: keys on disk, signatures the gate accepts."""

from __future__ import annotations

import os
import stat

import pytest

from engine.config import load_config
from engine.daemon.models.package_gate import PackageRefused, gate_package
from tools import keygen_cmd, sign_package_cmd
from workers.model_maker import make_model


@pytest.fixture
def package(tmp_path):
    return make_model(str(tmp_path / "models" / "m"), vocab=260, layers=1, d_model=16, heads=2, kv_heads=1,
                      golden_cases=1, golden_max_tokens=2, max_seq=64, kv_num_blocks=8)


def test_keygen_signing_writes_a_private_and_a_public_pem_and_never_overwrites(tmp_path, capsys):
    d = tmp_path / "keys"
    assert keygen_cmd.main(["--signing", str(d), "release"]) == 0
    priv, pub = d / "release.ed25519", d / "release.ed25519.pub"
    assert priv.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600 and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    out = capsys.readouterr().out
    assert str(priv) in out and f"signing_public_key): {pub}" in out
    before = priv.read_bytes()
    assert keygen_cmd.main(["--signing", str(d), "release"]) == 1
    assert "exists" in capsys.readouterr().err and priv.read_bytes() == before


def test_sign_package_signs_what_the_gate_then_accepts(tmp_path, package, capsys):
    keys = tmp_path / "keys"
    assert keygen_cmd.main(["--signing", str(keys), "release"]) == 0
    cfg = load_config(None, {"model.signing_public_key": str(keys / "release.ed25519.pub")}, env={})
    with pytest.raises(PackageRefused, match="manifest.sig: missing"):
        gate_package(cfg, str(tmp_path / "models"), "m")
    capsys.readouterr()
    assert sign_package_cmd.main(["--key", str(keys / "release.ed25519"), "--package", package]) == 0
    assert capsys.readouterr().out.strip() == os.path.join(package, "manifest.sig")
    assert gate_package(cfg, str(tmp_path / "models"), "m").path == os.path.realpath(package)


def test_sign_package_refuses_a_broken_package_or_a_bad_key(tmp_path, package, capsys):
    keys = tmp_path / "keys"
    assert keygen_cmd.main(["--signing", str(keys), "release"]) == 0
    capsys.readouterr()
    assert sign_package_cmd.main(["--key", str(keys / "release.ed25519.pub"), "--package", package]) == 1
    assert "not an unencrypted PEM private key" in capsys.readouterr().err
    with open(os.path.join(package, "golden.json"), "a") as f:
        f.write(" ")
    assert sign_package_cmd.main(["--key", str(keys / "release.ed25519"), "--package", package]) == 1
    err = capsys.readouterr().err
    assert "golden.json: sha256 does not match" in err and "only an intact package can be signed" in err
    assert not os.path.exists(os.path.join(package, "manifest.sig"))
