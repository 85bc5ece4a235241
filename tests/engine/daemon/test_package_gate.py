"""The package gate on real package folders: every refusal names its step and cause, for .npz and GGUF packages."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.config import load_config
from engine.daemon.models.package_gate import (
    PackageRefused, capacity_facts, gate_package, resolve_package, validate_package, verify_package,
)
from engine.daemon.models.package_signature import sign_package, write_key_pair
from workers.model_maker import make_model
from workers.package_manifest import write_manifest
from workers.tiny_gguf_package import make_gguf_model

# One layer, one KV head of 8 dims: KV bytes per token are 2*1*1*8*4 (ref, float32) and 1*1*(8+8)*2 (llama.cpp f16).
PARAMS = dict(vocab=260, layers=1, d_model=16, heads=2, kv_heads=1, golden_cases=1, golden_max_tokens=2,
              max_seq=64, kv_num_blocks=8, profiles=(1, 2))
KINDS = {  # kind: (maker, backend, the weights file, KV bytes per token)
    "npz": (make_model, "ref", "weights.npz", 64),
    "gguf": (make_gguf_model, "llamacpp", "model.gguf", 32),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Each kind of package built once; tests copy it into their own model root."""
    base = tmp_path_factory.mktemp("pristine")
    return {k: maker(str(base / k), **PARAMS) for k, (maker, *_) in KINDS.items()}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    return request.param


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "models"
    r.mkdir()
    return r


@pytest.fixture
def pkg(pristine, kind, root):
    """A fresh copy of the `kind` package at models/m."""
    dst = root / "m"
    shutil.copytree(pristine[kind], dst)
    return dst


def cfg_for(kind: str, **settings):
    return load_config(None, {"board.backend": KINDS[kind][1], **settings}, env={})


def refused(step: str, fn, *args) -> str:
    with pytest.raises(PackageRefused) as info:
        fn(*args)
    assert info.value.step == step, info.value
    assert str(info.value).startswith(f"{step}: ")
    return info.value.message


def test_a_good_package_passes_every_step_with_its_capacity_facts(kind, root, pkg):
    g = gate_package(cfg_for(kind), str(root), "m")
    assert g.path == os.path.realpath(pkg)
    assert g.sha256 == g.package.sha256 and len(g.sha256) == 64
    f = g.facts
    assert (f.format, f.max_seq, f.profiles, f.block_size, f.kv_num_blocks) == (kind, 64, (1, 2), 16, 8)
    assert f.kv_bytes_per_token == KINDS[kind][3]
    assert f.kv_bytes_per_block == 16 * KINDS[kind][3] and f.kv_pool_bytes == 8 * 16 * KINDS[kind][3]
    assert f.weight_bytes > 0 and f.worker_bytes == f.weight_bytes + f.kv_pool_bytes
    if kind == "npz":  # embed 260x16 + head 16x260 + norms 3x16 + attention/MLP of one layer, float32
        d = g.package.dims
        layer = d.d_model * d.heads * d.head_dim * 2 + d.d_model * d.kv_heads * d.head_dim * 2 \
            + 3 * d.d_model * d.ffn_dim
        assert f.weight_bytes == 4 * (2 * 260 * 16 + 3 * 16 + layer)
    else:
        assert f.weight_bytes == os.path.getsize(pkg / "model.gguf")
    # the config's KV pool size wins over the package default
    assert gate_package(cfg_for(kind, **{"kv.num_blocks": 3}), str(root), "m").facts.kv_num_blocks == 3


def test_a_tampered_weight_file_is_refused_naming_it(kind, root, pkg):
    weights = pkg / KINDS[kind][2]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    msg = refused("verify", gate_package, cfg_for(kind), str(root), "m")
    assert KINDS[kind][2] in msg and "sha256 does not match" in msg


def test_a_missing_file_is_refused_naming_it(kind, root, pkg):
    os.unlink(pkg / "golden.json")
    msg = refused("verify", gate_package, cfg_for(kind), str(root), "m")
    assert "golden.json" in msg and "missing" in msg


def test_an_unlisted_file_is_refused_naming_it(kind, root, pkg):
    (pkg / "notes.txt").write_text("hello")
    msg = refused("verify", gate_package, cfg_for(kind), str(root), "m")
    assert "notes.txt" in msg and "not listed in the manifest" in msg


def test_a_listed_file_that_is_a_symlink_out_of_the_package_is_refused(kind, root, pkg, tmp_path):
    name = KINDS[kind][2]
    outside = tmp_path / "outside.bin"
    shutil.move(pkg / name, outside)
    os.symlink(outside, pkg / name)  # same bytes, same sha256: refused for being a link
    msg = refused("verify", gate_package, cfg_for(kind), str(root), "m")
    assert name in msg and "not a regular file" in msg


def test_a_profile_the_package_does_not_declare_is_refused(kind, root, pkg):
    msg = refused("validate", gate_package, cfg_for(kind, **{"batch.profiles": [1, 4]}), str(root), "m")
    assert "batch.profiles" in msg and "[4] not among them" in msg and "[1, 2]" in msg


def test_max_prompt_tokens_must_be_below_the_package_max_seq(kind, root, pkg):
    msg = refused("validate", gate_package, cfg_for(kind, **{"admission.max_prompt_tokens": 64}), str(root), "m")
    assert "admission.max_prompt_tokens" in msg and "max_seq (64)" in msg


def test_a_package_for_another_backend_is_refused(kind, root, pkg):
    other = {"npz": "llamacpp", "gguf": "ref"}[kind]
    cfg = load_config(None, {"board.backend": other}, env={})
    msg = refused("validate", gate_package, cfg, str(root), "m")
    assert f"a {kind} package needs backend" in msg and repr(other) in msg
    # every mismatch is named at once
    cfg = load_config(None, {"board.backend": other, "batch.profiles": [8]}, env={})
    msg = refused("validate", validate_package, verify_package(str(pkg)), cfg)
    assert "needs backend" in msg and "batch.profiles" in msg


def test_a_path_outside_the_model_root_is_refused(kind, root, pristine):
    msg = refused("resolve", resolve_package, str(root), pristine[kind])  # absolute, outside
    assert "outside the model root" in msg and "symlink" not in msg
    msg = refused("resolve", resolve_package, str(root), f"../{os.path.basename(pristine[kind])}")
    assert "'..' is not allowed" in msg
    msg = refused("resolve", resolve_package, str(root), "nope")
    assert "no such package folder" in msg
    assert "model root itself" in refused("resolve", resolve_package, str(root), ".")


def test_a_symlink_out_of_the_model_root_is_refused(kind, root, pristine):
    os.symlink(pristine[kind], root / "escape")
    msg = refused("resolve", gate_package, cfg_for(kind), str(root), "escape")
    assert "through a symlink, outside the model root" in msg and os.path.realpath(pristine[kind]) in msg
    # a symlinked folder on the way counts the same
    os.symlink(os.path.dirname(pristine[kind]), root / "dir")
    msg = refused("resolve", resolve_package, str(root), f"dir/{kind}")
    assert "through a symlink" in msg


def test_without_a_model_root_the_path_is_taken_as_given(kind, root, pkg, monkeypatch):
    monkeypatch.chdir(root)
    assert resolve_package("", "m") == resolve_package("", str(pkg)) == os.path.realpath(pkg)
    assert "no such package folder" in refused("resolve", resolve_package, "", "none")
    (root / "empty").mkdir()
    assert "not a model package (no manifest.json)" in refused("resolve", resolve_package, "", "empty")
    assert "no package named" in refused("resolve", resolve_package, "", " ")


def test_symlinks_that_stay_inside_the_root_are_followed(kind, root, pkg):
    os.symlink(pkg, root / "current")
    assert resolve_package(str(root), "current") == os.path.realpath(pkg)
    assert resolve_package(str(root), str(root / "current")) == os.path.realpath(pkg)  # absolute, inside


# ---- signatures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {name: write_key_pair(str(d), name) for name in ("release", "other")}  # (private, public)


def signed_cfg(kind, keys):
    return cfg_for(kind, **{"model.signing_public_key": keys["release"][1]})


def test_a_good_signature_passes(kind, root, pkg, keys):
    sign_package(keys["release"][0], str(pkg))
    assert (pkg / "manifest.sig").is_file()
    g = gate_package(signed_cfg(kind, keys), str(root), "m")
    assert g.path == os.path.realpath(pkg)
    # without a configured key the signature file is not an unlisted file: it is ignored
    assert gate_package(cfg_for(kind), str(root), "m").sha256 == g.sha256


def test_an_unsigned_package_is_refused_when_a_key_is_configured(kind, root, pkg, keys):
    msg = refused("signature", gate_package, signed_cfg(kind, keys), str(root), "m")
    assert "manifest.sig" in msg and "missing" in msg and "npuserve sign-package" in msg


def test_a_signature_by_another_key_is_refused(kind, root, pkg, keys):
    sign_package(keys["other"][0], str(pkg))
    msg = refused("signature", gate_package, signed_cfg(kind, keys), str(root), "m")
    assert "signed by key" in msg and "not by the configured key" in msg


def test_a_manifest_changed_after_signing_is_refused(kind, root, pkg, keys):
    sign_package(keys["release"][0], str(pkg))
    m = json.loads((pkg / "manifest.json").read_text())
    m["name"] = "renamed"  # still a valid package with valid hashes: only the signature can tell
    (pkg / "manifest.json").write_text(json.dumps(m))
    assert verify_package(str(pkg)).name == "renamed"
    msg = refused("signature", gate_package, signed_cfg(kind, keys), str(root), "m")
    assert "does not verify against manifest.json" in msg


def test_a_forged_or_garbled_signature_is_refused(kind, root, pkg, keys):
    sign_package(keys["release"][0], str(pkg))
    sig = json.loads((pkg / "manifest.sig").read_text())
    forged = dict(sig, signature=sig["signature"][:-4] + ("AAA=" if sig["signature"][-4:] != "AAA=" else "BBB="))
    (pkg / "manifest.sig").write_text(json.dumps(forged))
    assert "does not verify" in refused("signature", gate_package, signed_cfg(kind, keys), str(root), "m")
    (pkg / "manifest.sig").write_text(json.dumps(dict(sig, signature="not base64!")))
    assert "not base64" in refused("signature", gate_package, signed_cfg(kind, keys), str(root), "m")
    (pkg / "manifest.sig").write_text("{")
    assert "not valid JSON" in refused("signature", gate_package, signed_cfg(kind, keys), str(root), "m")


def test_an_unreadable_configured_key_is_named(kind, root, pkg, keys, tmp_path):
    bad = tmp_path / "bad.pub"
    bad.write_text("not a key")
    cfg = cfg_for(kind, **{"model.signing_public_key": str(bad)})
    assert "not a PEM public key" in refused("signature", gate_package, cfg, str(root), "m")
    cfg = cfg_for(kind, **{"model.signing_public_key": keys["release"][0]})  # the private half by mistake
    assert "not a PEM public key" in refused("signature", gate_package, cfg, str(root), "m")


def test_capacity_facts_follow_the_served_block_size(root, pristine):
    """llama.cpp takes kv.block_size from the config; ref keeps the package's KV layout."""
    shutil.copytree(pristine["gguf"], root / "g")
    shutil.copytree(pristine["npz"], root / "n")
    g = verify_package(str(root / "g"))
    assert capacity_facts(g, cfg_for("gguf", **{"kv.block_size": 32})).kv_bytes_per_block == 32 * 32
    n = verify_package(str(root / "n"))
    assert capacity_facts(n, cfg_for("npz", **{"kv.block_size": 32})).block_size == 16


def test_gguf_kv_shape_from_the_manifest_or_the_gguf_metadata_agree(root, pristine):
    """Packages record kv_shape at import; older ones without it are sized from the GGUF metadata, the same."""
    shutil.copytree(pristine["gguf"], root / "g")
    pkg = verify_package(str(root / "g"))
    assert pkg.kv_shape == {"layers": 1, "kv_heads": 1, "key_length": 8, "value_length": 8}
    m = json.loads((root / "g" / "manifest.json").read_text())
    del m["kv_shape"]
    write_manifest(str(root / "g"), m)
    old = verify_package(str(root / "g"))
    assert old.kv_shape is None
    assert capacity_facts(old, cfg_for("gguf")).kv_bytes_per_token == capacity_facts(pkg, cfg_for("gguf")) \
        .kv_bytes_per_token == 32
    m["kv_shape"] = {"layers": 1, "kv_heads": 0, "key_length": 8, "value_length": 8}
    write_manifest(str(root / "g"), m)
    assert "kv_shape must be an object of positive integers" in refused("verify", verify_package, str(root / "g"))


def test_gemma_records_its_kv_shape_at_import(gemma_package):
    cfg = cfg_for("gguf")
    pkg = verify_package(gemma_package)
    assert pkg.kv_shape == {"layers": 18, "kv_heads": 1, "key_length": 256, "value_length": 256}
    facts = capacity_facts(pkg, cfg)
    assert facts.kv_bytes_per_token == 18 * 1 * (256 + 256) * 2
    assert facts.weight_bytes == os.path.getsize(pkg.gguf_path) > 200_000_000


def test_a_manifest_cannot_list_its_own_signature(root, pristine):
    """manifest.sig signs the manifest, so the manifest cannot pin it: listing it is a malformed manifest."""
    shutil.copytree(pristine["npz"], root / "n")
    (root / "n" / "manifest.sig").write_text("{}")
    m = json.loads((root / "n" / "manifest.json").read_text())
    write_manifest(str(root / "n"), m, [*m["files"], "manifest.sig"])
    msg = refused("verify", verify_package, str(root / "n"))
    assert "invalid file name 'manifest.sig'" in msg
