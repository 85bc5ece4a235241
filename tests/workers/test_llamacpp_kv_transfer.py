"""KV export / import on the `llamacpp` backend, Gemma 3 270M: a prefix leaves one worker and continues on another.

Two backend instances (two llama.cpp contexts, as two chip workers have),
the worker's own transfer code (`workers.kv_transfer.HostKv`) and a real
host slot pool between them: a prompt's whole blocks are exported by the
first, imported by the second into other block ids, and the second's greedy
continuation from there must be the first's uninterrupted run, token for
token; so must a run of blocks imported after a prefix the second worker
holds on its device (the demotion case: the device kept the first blocks).
Imports the backend cannot do exactly (a gap in the run, a damaged row) are
refused before the device KV changes.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.tier_transfers import HOST, chain_words
from ipc.kv_slots import KvSlotPool, RecordRefused, record_bytes
from ipc.records import Job, JobKind, Lane, build_job
from workers.backends.base import BackendError
from workers.backends.llamacpp import LlamacppBackend
from workers.kv_transfer import HostKv
from workers.package_loader import load_package

TEXT = ("The history of the Roman Empire begins with the founding of Rome, which according to legend happened "
        "in 753 BC when the twins Romulus and Remus")
STEPS = 12


@pytest.fixture(scope="module")
def pair(gemma_package):
    pkg = load_package(gemma_package)
    chips = [LlamacppBackend(threads=1, chip_id=i) for i in range(2)]
    for b in chips:
        b.load(pkg)
    info = chips[0].describe()
    pool = KvSlotPool.create("npuservetest", "kvl", 8, record_bytes(info.kv.block_bytes()))
    try:
        yield chips, [HostKv(pool, b, b.describe()) for b in chips]
    finally:
        for b in chips:
            b.unload()
        pool.close()
        pool.unlink()


def _greedy(b, prompt, table, start=0):
    out = [int(np.argmax(b.prefill(build_job(JobKind.PREFILL, [Lane(prompt[start:], start, table)])).logits[0]))]
    while len(out) < STEPS:
        job = build_job(JobKind.DECODE, [Lane([out[-1]], len(prompt) + len(out) - 1, table)])
        out.append(int(np.argmax(b.decode(job).logits[0])))
    return out


def _transfer(kind, src, dst, first=0):
    chains = [bytes([first + i + 1]) * 16 for i in range(len(src))]
    j = Job.kv_copy(1, 1, src, dst, kind=kind)
    j.tokens = chain_words(chains)
    j.positions = np.full(len(src), HOST, np.int32)
    return j


def test_a_prefix_exported_by_one_worker_continues_on_another_as_the_uninterrupted_run(pair, gemma_package):
    from workers.llamacpp.tokenizer import GgufTokenizer

    (a, b), (host_a, host_b) = pair
    tok = GgufTokenizer(f"{gemma_package}/model.gguf")
    prompt = tok.encode(TEXT)
    tok.close()
    bs = a.block_size
    whole = len(prompt) // bs
    assert whole >= 2 and len(prompt) % bs, "the prompt must end inside a block"
    info = a.describe()
    assert info.kv_transfer is not None and info.kv.block_bytes() >= a._kv_io.state_bytes

    table_a = list(range(whole + 2))
    want = _greedy(a, prompt, table_a)
    host_a.run(_transfer(JobKind.KV_EXPORT, table_a[:whole], list(range(whole))))  # into host slots 0..whole-1

    # refused, and nothing written: a run out of order, and a damaged row
    with pytest.raises(RecordRefused, match="not the next whole block"):
        b.swap_in(np.array([40, 41]), a.swap_out(np.array([table_a[1], table_a[0]])))
    bad = a.swap_out(np.array(table_a[:whole]))
    bad[0, :8] = 0
    with pytest.raises(RecordRefused):
        b.swap_in(np.array(range(40, 40 + whole)), bad)
    assert b.health()["sequences"] == 0

    table_b = list(range(100, 100 + whole + 2))  # other block ids on the other chip
    host_b.run(_transfer(JobKind.KV_IMPORT, list(range(whole)), table_b[:whole]))
    got = _greedy(b, prompt, table_b, start=whole * bs)
    assert got == want

    # what the import put there is what the export read: a re-export gives the same bytes
    assert np.array_equal(b.swap_out(np.array(table_b[:whole])), a.swap_out(np.array(table_a[:whole])))
    b.release_blocks(table_b)
    with pytest.raises(BackendError, match="no whole block"):
        b.swap_out(np.array(table_b[:1]))

    # the device holds block 0 (computed here), the host the rest: the run joins it when the lane comes
    table_c = list(range(150, 150 + whole + 2))
    b.prefill(build_job(JobKind.PREFILL, [Lane(prompt[:bs], 0, table_c[:1], sample=False)]))
    host_b.run(_transfer(JobKind.KV_IMPORT, list(range(1, whole)), table_c[1:whole], first=1))
    assert _greedy(b, prompt, table_c, start=whole * bs) == want
    b.release_blocks(table_c)
    assert b.health()["sequences"] == 0
