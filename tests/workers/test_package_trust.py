"""One verification per load: a worker given the daemon's verified manifest hash does not hash every file again."""

import hashlib
import os

import pytest

import workers.model_package as mp
import workers.package_loader as loader
from workers.model_maker import make_model
from workers.package_manifest import PackageError


@pytest.fixture(scope="module")
def pkg_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("trust") / "m"), max_seq=64, kv_num_blocks=8, golden_cases=1)


def test_a_verified_package_is_not_hashed_again_but_its_manifest_must_be_the_verified_one(pkg_path, monkeypatch):
    sha = loader.load_package(pkg_path).sha256
    calls = []
    monkeypatch.setattr(mp, "verify_listed_files", lambda *a: calls.append(a))
    assert loader.load_package(pkg_path, verified_sha256=sha).sha256 == sha
    assert calls == []  # trusted: the listed files are not hashed again
    loader.load_package(pkg_path)
    assert len(calls) == 1  # untrusted: they are
    with pytest.raises(PackageError) as e:
        loader.load_package(pkg_path, verified_sha256=hashlib.sha256(b"another manifest").hexdigest())
    assert "manifest.json: changed since the daemon verified" in str(e.value)


def test_weights_are_still_checked_against_the_manifest_when_parsed(pkg_path, tmp_path):
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(pkg_path, copy)
    sha = loader.load_package(copy).sha256
    with open(os.path.join(copy, "weights.npz"), "r+b") as fh:  # swapped after the daemon verified it
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 1]))
    pkg = loader.load_package(copy, verified_sha256=sha)
    with pytest.raises(PackageError) as e:
        pkg.weights()
    assert "sha256 does not match" in str(e.value)
