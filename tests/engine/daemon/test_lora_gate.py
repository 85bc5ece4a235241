"""The adapter gate's file-system steps: the folder, the optional signature (signed with `npuserve sign-package`),
every sha256. No daemon: `verify_adapter` is pure over the file system."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.daemon.lora_registry import AdapterRefused, verify_adapter
from engine.daemon.models.package_signature import write_key_pair
from tools.sign_package_cmd import main as sign_main
from workers.lora.maker import make_lora
from workers.model_maker import make_model


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    base = make_model(str(root / "base"), max_seq=64, kv_num_blocks=8, golden_cases=1)
    return str(root), make_lora(base, str(root / "a"), rank=2, seed=1)


def test_a_signed_adapter_passes_and_a_wrong_or_missing_signature_is_refused(adapter, tmp_path):
    root, path = adapter
    priv, pub = write_key_pair(str(tmp_path), "k")
    other_priv, other_pub = write_key_pair(str(tmp_path), "other")
    signed = str(tmp_path / "signed")
    shutil.copytree(path, signed)
    assert sign_main(["--key", priv, "--package", signed]) == 0
    facts = verify_adapter(signed, public_key=pub)
    assert facts.rank == 2
    with pytest.raises(AdapterRefused) as e:
        verify_adapter(signed, public_key=other_pub)
    assert e.value.step == "signature"
    with pytest.raises(AdapterRefused) as e:
        verify_adapter(path, public_key=pub)  # never signed
    assert e.value.step == "signature"


def test_the_folder_and_the_hashes_are_checked(adapter, tmp_path):
    root, path = adapter
    with pytest.raises(AdapterRefused) as e:
        verify_adapter(str(tmp_path / "nowhere"))
    assert e.value.step == "resolve"
    extra = str(tmp_path / "extra")
    shutil.copytree(path, extra)
    open(os.path.join(extra, "stray.bin"), "wb").write(b"x")
    with pytest.raises(AdapterRefused, match="not listed in the manifest") as e:
        verify_adapter(extra)
    assert e.value.step == "verify"
    wrong = str(tmp_path / "wrong")
    shutil.copytree(path, wrong)
    m = json.load(open(os.path.join(wrong, "manifest.json")))
    m["targets"] = ["wq", "nope"]
    json.dump(m, open(os.path.join(wrong, "manifest.json"), "w"))
    with pytest.raises(AdapterRefused, match="targets must be"):
        verify_adapter(wrong)


def test_inside_a_model_root_the_admin_op_cannot_leave_it(adapter, tmp_path):
    root, path = adapter
    with pytest.raises(AdapterRefused) as e:
        verify_adapter("../a", model_root=str(tmp_path), resolve=True)
    assert e.value.step == "resolve"
    assert verify_adapter("a", model_root=root, resolve=True).path == os.path.realpath(path)
