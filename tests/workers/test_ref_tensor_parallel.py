"""The `ref` backend sharded across 2 and 4 processes (Megatron-style, all-reduce over shared
memory) gives what one process gives: logits within float tolerance, greedy tokens
equal, sampled tokens equal for the same seeds -- across prefix hits, chunked
prefill, a preempted sequence recomputed elsewhere, mixed batches and KV copies.
"""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import Job, JobKind, JobStatus, Lane, build_job
from workers.model_maker import make_model
from workers.package_loader import load_package
from workers.package_manifest import PackageError
from workers.transformer import ModelDims, Transformer
from tools.tp_ranks import run_group

pytestmark = pytest.mark.integration
TOL = 2e-4


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    # 8 query heads over 4 KV heads, ffn 96: degrees 1, 2 and 4.
    return make_model(str(tmp_path_factory.mktemp("tp") / "m"), layers=2, d_model=64, heads=8, kv_heads=4,
                      head_dim=8, ffn_dim=96, max_seq=256, kv_num_blocks=64, seed=5, golden_cases=1)


def _seq(seed: int, n: int) -> list[int]:
    return [256] + np.random.default_rng(seed).integers(0, 256, n - 1).tolist()


def scenario(info, steps: int = 4):
    """Prefill with a prefix hit, chunked prefill, a mixed batch, decode (greedy and sampled),
    a preempted sequence recomputed into other blocks, and a copy-on-write block copy."""
    a, b, c, d = _seq(1, 60), _seq(1, 32) + _seq(2, 28), _seq(3, 70), _seq(4, 40)
    ta, tb, tc, td = [3, 7, 9, 10, 30], [3, 7, 11, 12, 31], [13, 14, 15, 16, 17], [20, 21, 22, 23]

    def job(kind, lanes):
        return build_job(kind, lanes, return_logits=True)

    yield job(JobKind.PREFILL, [Lane(a[:40], 0, ta)])
    yield job(JobKind.PREFILL, [Lane(b[32:40], 32, tb, temperature=0.9, seed=7)])  # prefix hit: blocks 3, 7
    for lo, hi in ((0, 17), (17, 34), (34, 50)):  # chunked prefill: only the last chunk samples
        yield job(JobKind.PREFILL, [Lane(c[lo:hi], lo, tc, sample=hi == 50)])
    # A mixed batch: two decode lanes (one token each) beside a prompt chunk.
    yield job(JobKind.PREFILL, [Lane([a[40]], 40, ta), Lane(d[:25], 0, td, temperature=0.7, top_k=20, seed=3),
                                Lane([b[40]], 40, tb, temperature=1.1, top_p=0.9, seed=11)])
    for s in range(steps):
        yield job(JobKind.DECODE, [Lane([a[41 + s]], 41 + s, ta),
                                   Lane([b[41 + s]], 41 + s, tb, temperature=0.8, seed=100 + s, want_logprobs=True),
                                   None,
                                   Lane([c[50 + s]], 50 + s, tc, temperature=1.0, top_k=40, seed=9)])
    # b preempted: its KV dropped, recomputed from its tokens into other blocks, then decoded on.
    n = 41 + steps
    yield job(JobKind.PREFILL, [Lane(b[:n], 0, [40, 41, 42, 43], temperature=0.8, seed=55)])
    yield job(JobKind.DECODE, [Lane([b[n]], n, [40, 41, 42, 43], temperature=0.8, seed=56)])
    # Copy-on-write: a's first three blocks copied, then decoded from the copy.
    yield Job.kv_copy(0, 0, np.array([3, 7, 9], np.int32), np.array([50, 51, 52], np.int32))
    yield job(JobKind.DECODE, [Lane([a[41 + steps]], 41 + steps, [50, 51, 52, 10, 30])])


@pytest.fixture(scope="module")
def tp1(package):
    return run_group(1, package, "tests.workers.test_ref_tensor_parallel:scenario")


@pytest.mark.parametrize("world", [2, 4])
def test_tp_equals_tp1(package, tp1, world):
    got = run_group(world, package, "tests.workers.test_ref_tensor_parallel:scenario")
    assert got.statuses == tp1.statuses == [int(JobStatus.OK)] * len(tp1.statuses)
    assert got.allreduce_calls > 0
    compared = 0
    for i, (l1, lt) in enumerate(zip(tp1.logits, got.logits)):
        assert (l1 is None) == (lt is None), i
        if l1 is not None:
            assert float(np.abs(l1 - lt).max()) <= TOL, i
            compared += 1
        assert np.array_equal(tp1.tokens[i], got.tokens[i]), (i, tp1.tokens[i], got.tokens[i])
        assert np.allclose(tp1.logprobs[i], got.logprobs[i], atol=1e-4), i
    assert compared >= 10
    assert sum(int((t >= 0).sum()) for t in got.tokens) >= 20  # tokens were sampled, not all masked


def test_transformer_refuses_a_degree_the_shape_does_not_split(package):
    pkg = load_package(package)
    assert pkg.tp_degrees == (1, 2, 4)
    pkg.check_tp_degree(4)
    with pytest.raises(PackageError, match="does not support tensor-parallel degree 3"):
        pkg.check_tp_degree(3)
    with pytest.raises(ValueError, match="supports"):
        Transformer(pkg.dims, pkg.weights(), vocab_size=pkg.vocab_size, max_seq=pkg.max_seq, shard=(0, 8),
                    reduce=lambda x: x)
    assert ModelDims(layers=1, d_model=8, heads=6, kv_heads=3, head_dim=2, ffn_dim=9).tp_degrees() == (1, 3)


def test_manifest_may_narrow_tp_degrees(tmp_path):
    import json
    import os

    from workers.package_manifest import write_manifest

    path = make_model(str(tmp_path / "m"), heads=4, kv_heads=2, ffn_dim=32, kv_num_blocks=8, max_seq=64,
                      golden_cases=1)
    mpath = os.path.join(path, "manifest.json")
    m = json.load(open(mpath))
    m["tp_degrees"] = [1]
    write_manifest(path, m)
    assert load_package(path).tp_degrees == (1,)
    m["tp_degrees"] = [1, 4]  # 4 does not divide 2 KV heads
    write_manifest(path, m)
    with pytest.raises(PackageError, match="tp_degrees"):
        load_package(path)
