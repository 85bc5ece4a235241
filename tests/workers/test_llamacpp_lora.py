"""LoRA on the llamacpp backend: llama.cpp's LoRA GGUF through its adapter API, one adapter per job.

The tiny model exists as an npz package (ref) and as GGUF (llama.cpp) with the
same weights; the same adapter converted to a LoRA GGUF must give llama.cpp
the ref backend's greedy tokens under the npz adapter (which equals the
merged model: tests/workers/test_lora_ref.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import JobKind, Lane, build_job
from workers.backends.base import BackendError
from workers.backends.ref import RefBackend
from workers.lora.adapter_package import read_adapter_facts
from workers.lora.gguf_adapter import check_gguf_against_base, npz_adapter_to_gguf
from workers.lora.maker import make_lora
from workers.model_maker import make_model
from workers.package_loader import load_package
from workers.package_manifest import PackageError
from workers.tiny_gguf_package import make_gguf_model

pytest.importorskip("xllamacpp")

P = dict(max_seq=256, kv_num_blocks=64, seed=5, golden_cases=1)
ALL = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]


@pytest.fixture(scope="module")
def pkgs(tmp_path_factory):
    d = tmp_path_factory.mktemp("llora")
    npz, gg = make_model(str(d / "n"), **P), make_gguf_model(str(d / "g"), **P)
    npz_ad = make_lora(npz, str(d / "a"), rank=4, targets=ALL, seed=3)
    gg_ad = npz_adapter_to_gguf(npz_ad, load_package(gg), str(d / "ga"))
    return d, npz, gg, npz_ad, gg_ad


@pytest.fixture(scope="module")
def llama(pkgs):
    from workers.backends.llamacpp import LlamacppBackend

    _, _, gg, _, gg_ad = pkgs
    b = LlamacppBackend()
    b.load(load_package(gg))
    b.load_adapter(0, b.read_adapter(gg_ad, ""))
    yield b
    b.unload()


def _greedy(b, slot: int, prompt: list[int], n: int, table: list[int]) -> list[int]:
    job = build_job(JobKind.PREFILL, [Lane(prompt, 0, table)])
    out: list[int] = []
    while len(out) < n:
        job.adapter = np.array([slot], np.int32)
        logits = (b.prefill(job) if job.kind == JobKind.PREFILL else b.decode(job)).logits[0]
        out.append(int(np.argmax(logits)))
        job = build_job(JobKind.DECODE, [Lane([out[-1]], len(prompt) + len(out) - 1, table)])
    return out


def test_llamacpp_under_the_lora_gguf_gives_the_ref_backends_tokens_under_the_npz_adapter(pkgs, llama):
    _, npz, _, npz_ad, _ = pkgs
    ref = RefBackend(lora_slots=1)
    ref.load(npz)
    ref.load_adapter(0, ref.read_adapter(npz_ad, ""))
    prompt = [256] + list(range(10, 30))
    with_adapter = _greedy(llama, 0, prompt, 10, list(range(0, 4)))
    assert with_adapter == _greedy(ref, 0, prompt, 10, list(range(4)))
    base = _greedy(llama, -1, prompt, 10, list(range(4, 8)))  # the adapter is off again for the base
    assert base == _greedy(ref, -1, prompt, 10, list(range(4, 8))) != with_adapter


def test_a_job_mixing_adapters_or_naming_an_empty_slot_is_refused_before_it_runs(llama):
    job = build_job(JobKind.PREFILL, [Lane([256, 5, 6], 0, [20]), Lane([256, 7, 8], 0, [21])])
    job.adapter = np.array([0, -1], np.int32)
    with pytest.raises(ValueError, match="one adapter set per context"):
        llama.prefill(job)
    job.adapter = np.array([3, 3], np.int32)
    with pytest.raises(ValueError, match="slot 3 holds no adapter"):
        llama.prefill(job)
    assert llama.describe().extra["lora"] == {"slots": 8, "mixed": False}


def test_make_lora_for_a_gguf_base_writes_a_lora_gguf_llama_cpp_loads(pkgs, llama):
    d, _, gg, _, _ = pkgs
    path = make_lora(gg, str(d / "made"), rank=2, targets=["wv", "w_up"], seed=1)
    facts = read_adapter_facts(path)
    assert (facts.format, facts.rank, facts.targets) == ("gguf", 2, ("wv", "w_up"))
    llama.load_adapter(1, llama.read_adapter(path, ""))
    prompt = [256, 40, 41, 42]
    assert _greedy(llama, 1, prompt, 6, [30]) != _greedy(llama, -1, prompt, 6, [31])
    llama.unload_adapter(1)


def test_a_lora_gguf_for_another_base_is_refused_from_the_headers(pkgs, tmp_path):
    _, _, gg, _, _ = pkgs
    other = make_gguf_model(str(tmp_path / "wide"), d_model=96, max_seq=64, kv_num_blocks=8, golden_cases=1)
    path = make_lora(other, str(tmp_path / "for-wide"), rank=2, seed=1)
    with pytest.raises(PackageError, match="the base model's"):
        check_gguf_against_base(read_adapter_facts(path), load_package(gg).gguf_path)
    deeper = make_gguf_model(str(tmp_path / "deep"), layers=3, max_seq=64, kv_num_blocks=8, golden_cases=1)
    path = make_lora(deeper, str(tmp_path / "for-deep"), rank=2, seed=1)
    with pytest.raises(PackageError, match="made for 3 layers"):
        check_gguf_against_base(read_adapter_facts(path), load_package(gg).gguf_path)
    with pytest.raises(BackendError):
        from workers.backends.llamacpp import LlamacppBackend
        b = LlamacppBackend()
        b.load(load_package(gg))
        try:
            b.load_adapter(0, str(tmp_path / "for-deep" / "adapter.gguf"))  # llama.cpp's own check refuses it too
        finally:
            b.unload()


def test_the_header_reader_agrees_with_ggufs_own(pkgs):
    import gguf

    from workers.lora.gguf_header import read_gguf_header

    _, _, gg, _, gg_ad = pkgs
    for path in (load_package(gg).gguf_path, f"{gg_ad}/adapter.gguf"):
        meta, shapes = read_gguf_header(path, chunk=64)  # a small first read: the header is read on in chunks
        r = gguf.GGUFReader(path, "r")
        assert shapes == {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
        assert meta["general.architecture"] == r.fields["general.architecture"].contents()
    assert meta["adapter.type"] == "lora" and meta["adapter.lora.alpha"] == 8.0
