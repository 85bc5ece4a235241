"""LoRA adapters on the ref backend: the adapter package, its base-model checks, and the per-lane product.

The oracle of an adapter run is the base model with the adapter merged into
its weights (W + alpha/r * A @ B), computed cache-free by `dense_logits`: the
per-lane product and the merge share nothing but the adapter's tensors.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from ipc.records import Job, JobKind, Lane, build_job
from workers.backends.ref import RefBackend
from workers.execute_job import execute_job
from workers.lora.adapter_package import (ADAPTER_FILE, check_against_base, read_adapter, read_adapter_facts,
                                          tensor_names)
from workers.lora.maker import make_lora
from workers.model_maker import make_model
from workers.package_loader import load_package
from workers.package_manifest import PackageError
from workers.transformer import Transformer, weight_shapes

TOL = 2e-4
ALL = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# 8 adapters: ranks and targets differ, so lanes of one job run different shapes of product
SPECS = [(4, ("wq", "wv")), (8, ALL), (2, ("wo",)), (16, ("w_gate", "w_up", "w_down")), (8, ("wk", "wv")),
         (1, ALL), (4, ("wq", "w_down")), (8, ("wv", "w_up"))]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return load_package(make_model(str(tmp_path_factory.mktemp("base") / "m"), max_seq=256, kv_num_blocks=256,
                                   seed=5, golden_cases=1))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return [make_lora(base.path, str(root / f"a{i}"), rank=r, targets=t, seed=100 + i) for i, (r, t) in enumerate(SPECS)]


@pytest.fixture(scope="module")
def backend(base, adapters):
    b = RefBackend(lora_slots=8)
    b.load(base)
    for slot, path in enumerate(adapters):
        b.load_adapter(slot, b.read_adapter(path, ""))
    return b


def _seq(seed: int, n: int) -> list[int]:
    return [256] + np.random.default_rng(seed).integers(0, 256, n - 1).tolist()


def _with_adapter(job: Job, slots) -> Job:
    job.adapter = np.asarray(slots, np.int32)
    return job


def _merged(base, path) -> Transformer:
    w = read_adapter(read_adapter_facts(path)).merged_into(base.weights())
    return Transformer(base.dims, w, vocab_size=base.vocab_size, max_seq=base.max_seq)


def _greedy_paged(b: RefBackend, slot: int, prompt: list[int], n: int, table: list[int]):
    """Greedy tokens and each step's logits through the paged path, one lane under adapter `slot`."""
    out = b.prefill(_with_adapter(build_job(JobKind.PREFILL, [Lane(prompt, 0, table)]), [slot])).logits[0]
    logits, toks = [out], []
    for step in range(n):
        tok = int(np.argmax(logits[-1]))
        toks.append(tok)
        job = build_job(JobKind.DECODE, [Lane([tok], len(prompt) + step, table)])
        logits.append(b.decode(_with_adapter(job, [slot])).logits[0])
    return toks, logits


@pytest.mark.parametrize("which", [1, 3, 5])
def test_adapter_run_equals_the_model_with_the_adapter_merged(backend, base, adapters, which):
    prompt = _seq(which, 21)
    toks, logits = _greedy_paged(backend, which, prompt, 8, list(range(40, 42)))
    merged = _merged(base, adapters[which])
    dense = merged.dense_logits(prompt + toks)
    for i, row in enumerate(logits):
        assert np.abs(row - dense[len(prompt) - 1 + i]).max() <= TOL
    want, seq = [], list(prompt)
    for _ in range(8):
        want.append(int(np.argmax(merged.dense_logits(seq)[-1])))
        seq.append(want[-1])
    assert toks == want
    # not trivially true: the adapter changes the base model's logits
    base_dense = Transformer(base.dims, base.weights(), vocab_size=base.vocab_size,
                             max_seq=base.max_seq).dense_logits(prompt)
    assert np.abs(base_dense[-1] - dense[len(prompt) - 1]).max() > 0.1


def test_a_batch_of_8_adapters_and_the_base_gives_each_lane_its_solo_tokens(backend, base):
    slots = list(range(8)) + [-1]
    prompts = [_seq(50 + i, 5 + 3 * i) for i in range(9)]
    tables = [[100 + 4 * i + j for j in range(4)] for i in range(9)]
    solo = [_greedy_paged(backend, s, p, 6, [200 + j for j in range(4)]) for s, p in zip(slots, prompts)]
    # all nine prompts in one prefill job, then six decode steps of nine lanes
    job = build_job(JobKind.PREFILL, [Lane(p, 0, t) for p, t in zip(prompts, tables)])
    out = backend.prefill(_with_adapter(job, slots)).logits
    toks = [[] for _ in slots]
    for step in range(6):
        for i in range(9):
            assert np.abs(out[i] - solo[i][1][step]).max() <= TOL
            toks[i].append(int(np.argmax(out[i])))
        lanes = [Lane([toks[i][-1]], len(prompts[i]) + step, tables[i]) for i in range(9)]
        out = backend.decode(_with_adapter(build_job(JobKind.DECODE, lanes, batch=16), slots + [-1] * 7)).logits
    assert toks == [s[0] for s in solo]
    assert len({tuple(t) for t in toks}) > 1  # the lanes are not all the same run


def test_seeded_sampling_alone_equals_in_the_crowd(backend):
    slots = [0, 1, 2, -1, 3, 4, 5, 6, 7]
    prompts = [_seq(70 + i, 9) for i in range(9)]
    seeds = [1000 + i for i in range(9)]

    def run(idx: list[int], table_base: int) -> list[list[int]]:
        tables = {i: [table_base + 3 * k + j for j in range(3)] for k, i in enumerate(idx)}
        lanes = [Lane(prompts[i], 0, tables[i], temperature=0.9, top_p=0.95, seed=seeds[i]) for i in idx]
        res = execute_job(backend, _with_adapter(build_job(JobKind.PREFILL, lanes), [slots[i] for i in idx]))
        got = [[int(res.tokens[k])] for k in range(len(idx))]
        for step in range(5):
            lanes = [Lane([got[k][-1]], len(prompts[i]) + step, tables[i], temperature=0.9, top_p=0.95,
                          seed=seeds[i]) for k, i in enumerate(idx)]
            res = execute_job(backend, _with_adapter(build_job(JobKind.DECODE, lanes), [slots[i] for i in idx]))
            for k in range(len(idx)):
                got[k].append(int(res.tokens[k]))
        return got

    crowd = run(list(range(9)), 0)
    alone = [run([i], 60)[0] for i in range(9)]
    assert crowd == alone


def test_a_slot_without_an_adapter_is_refused_before_any_kv_write(base):
    b = RefBackend(lora_slots=2)
    b.load(base)
    before = b.cache.swap_out(np.array([3]))
    job = _with_adapter(build_job(JobKind.PREFILL, [Lane(_seq(1, 5), 0, [3])]), [1])
    with pytest.raises(ValueError, match="slot 1 holds no adapter"):
        b.prefill(job)
    assert np.array_equal(b.cache.swap_out(np.array([3])), before)


def test_job_adapter_field_round_trips_the_wire_beside_drafts():
    lanes = [Lane([1, 2, 3], 0, [0], drafts=1), Lane([4], 0, [1])]
    job = _with_adapter(build_job(JobKind.PREFILL, lanes, batch=4), [3, -1, -1, -1])
    back = Job.from_arrays(job.to_arrays())
    assert back.adapter.tolist() == [3, -1, -1, -1]
    assert back.draft_lens.tolist() == job.draft_lens.tolist()
    assert back.tokens.tolist() == job.tokens.tolist()
    plain = Job.from_arrays(build_job(JobKind.PREFILL, lanes).to_arrays())
    assert plain.adapter.size == 0
    with pytest.raises(ValueError, match="adapter"):
        _with_adapter(build_job(JobKind.PREFILL, lanes), [0]).validate()


# ---- the adapter package and its base-model checks ----------------------------------------------------

def _check(base, path):
    facts = read_adapter_facts(path)
    check_against_base(facts, "llama-like", base.dims.layers, weight_shapes(base.dims, base.vocab_size))
    return facts


def test_an_adapter_for_another_base_is_refused_naming_the_mismatch(base, tmp_path):
    deeper = load_package(make_model(str(tmp_path / "deep"), layers=3, max_seq=64, kv_num_blocks=8, golden_cases=1))
    wider = load_package(make_model(str(tmp_path / "wide"), d_model=96, heads=4, kv_heads=2, max_seq=64,
                                    kv_num_blocks=8, golden_cases=1))
    for other, reason in ((deeper, "made for 3 layers, the base model has 2"), (wider, "the base model needs")):
        path = make_lora(other.path, str(tmp_path / f"for-{os.path.basename(other.path)}"), rank=4, seed=1)
        with pytest.raises(PackageError, match=reason):
            _check(base, path)
        b = RefBackend()
        b.load(base)
        with pytest.raises(PackageError, match=reason):
            b.read_adapter(path, "")


def test_the_shape_check_reads_headers_only(base, adapters, tmp_path, monkeypatch):
    """An adapter for another base is refused without its tensors being parsed."""
    import workers.lora.adapter_package as ap
    calls = []
    monkeypatch.setattr(ap.np, "load", lambda *a, **k: calls.append(a))
    _check(base, adapters[0])
    assert calls == []


def test_a_damaged_adapter_is_refused(base, adapters, tmp_path):
    path = str(tmp_path / "damaged")
    shutil.copytree(adapters[0], path)
    with open(os.path.join(path, ADAPTER_FILE), "r+b") as f:
        f.seek(-20, os.SEEK_END)
        f.write(b"\xff" * 8)
    with pytest.raises(PackageError, match="sha256 does not match"):
        read_adapter_facts(path)
    bad_manifest = str(tmp_path / "badm")
    shutil.copytree(adapters[0], bad_manifest)
    mpath = os.path.join(bad_manifest, "manifest.json")
    m = json.load(open(mpath))
    m["rank"] = 0
    json.dump(m, open(mpath, "w"))
    with pytest.raises(PackageError, match="rank must be"):
        read_adapter_facts(bad_manifest)


def test_make_lora_writes_every_target_of_every_layer(base, adapters):
    facts = read_adapter_facts(adapters[1])
    assert facts.rank == 8 and facts.targets == ALL and facts.base_sha256 == base.sha256
    w = read_adapter(facts)
    assert set(w.pairs) == {(i, t) for i in range(base.dims.layers) for t in ALL}
    a, b = w.pairs[(1, "wo")]
    shapes = weight_shapes(base.dims, base.vocab_size)
    assert a.shape == (shapes["layers.1.wo"][0], 8) and b.shape == (8, shapes["layers.1.wo"][1])
    assert tensor_names(1, "wo") == ("layers.1.wo.lora_a", "layers.1.wo.lora_b")
    with pytest.raises(FileExistsError):
        make_lora(base.path, adapters[1])
