"""`npuserve bench serve lora --backend llamacpp` end to end on the tiny GGUF model: the mechanics of the Gemma row
(the figures are measured on Gemma 3 270M, docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from repo_root import ROOT
from tools.bench.serve.lora_peer import equal_texts
from tools.load import limits as lim
from workers.default_package import ensure_default_gguf_package


def test_the_mix_runs_on_both_servers_with_the_same_texts_and_prints_figure_bound_and_target():
    pkg = ensure_default_gguf_package()
    r = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "serve", "lora", "--backend", "llamacpp",
                        "--package", pkg, "--adapters", "2", "--streams", "2", "--requests", "4", "--max-tokens", "6",
                        "--prompt-tokens", "16", "--rounds", "1", "--threads", "1", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert all(next(iter(x)) == "kind" for x in lines)  # the --json convention (tools/json_lines.py)
    rows = {x["label"]: x for x in lines if x["kind"] == "row"}
    assert set(rows) == {"npuserve", "llama.cpp", "npuserve base"}
    for x in rows.values():
        assert x["requests"] == 4 and x["errors"] == 0 and x["generated_tokens"] == 4 * 6 and x["streams"] == 2
    (summary,) = [x for x in lines if x["kind"] == "summary"]
    # llama.cpp's server applied each request's adapter as npuserve did: the same texts, none the base model's
    assert summary["texts"]["equal"] == summary["texts"]["of"] == 4
    assert summary["texts"]["differ_from_base"] >= 1
    (limit,) = [x for x in lines if x["kind"] == "limit"]
    tok = rows["npuserve"]["tokens_per_s"], rows["llama.cpp"]["tokens_per_s"], rows["npuserve base"]["tokens_per_s"]
    assert limit["figure"] == round(tok[0] / tok[1], 3) and limit["bound"] == round(tok[2] / tok[1], 3)
    assert limit["target"] == ">= 1.5x"


def test_a_failed_answer_is_never_an_equal_text():
    assert equal_texts(["a", None, "c", "d"], ["a", None, "x", "d"]) == {"equal": 2, "of": 4, "first_different": 1}
    assert equal_texts(["a"], ["a"])["first_different"] is None


def test_own_best_bounds_the_ratio_by_the_subjects_easier_run_over_the_peer():
    x = lim.own_best("mix", 1.2, 300.0, 150.0, "base only", ">= 1.5x")
    assert x.bound == 2.0 and x.of_bound == 0.6
    assert lim.own_best("mix", 1.2, None, 150.0, "base only", ">= 1.5x").bound is None


def test_the_llamacpp_flags_are_refused_on_the_ref_row(capsys):
    from tools.load import lora_mix

    with pytest.raises(SystemExit) as e:
        lora_mix.main(["--package", "some-gguf"])
    assert e.value.code == 2 and "for --backend llamacpp" in capsys.readouterr().err
