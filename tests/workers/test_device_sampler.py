"""The reference chip's C sampler (the device side of simpler_model_decode_steps_paged) draws exactly the tokens
`workers.sampling.sample` draws, on thousands of rows: every path (greedy, temperature alone, top-k, top-p,
both), ties (quantised logits, whole tied rows, neighbouring float32 values), -inf logits, subnormal gaps, a candidate set that must widen, the filters
switched off every way (top_p = 1 or above, top_k = 0, negative, >= vocab), temperature 0 and tiny. Logprobs
agree to float32 tolerance. It is called through the library's test entry `ref_sample_rows`."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from workers.backends.ctypes_backend import build_reference_library
from workers.sampling import sample

E_INVALID, E_DEVICE = -1, -3


@pytest.fixture(scope="module")
def c_sample(tmp_path_factory):
    lib = ctypes.CDLL(str(build_reference_library(tmp_path_factory.mktemp("sampler"))))
    fn = lib.ref_sample_rows
    fn.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 8
    fn.restype = ctypes.c_int

    def run(z, temperature, top_p, top_k, seed, positions):
        z = np.ascontiguousarray(z, np.float32)
        b, v = z.shape
        args = [np.ascontiguousarray(a, dt) for a, dt in ((temperature, np.float32), (top_p, np.float32),
                                                          (top_k, np.int32), (seed, np.uint64),
                                                          (positions, np.int64))]
        tokens, logprobs = np.full(b, -7, np.int32), np.zeros(b, np.float32)
        rc = fn(b, v, z.ctypes.data, *(a.ctypes.data for a in args), tokens.ctypes.data, logprobs.ctypes.data)
        return rc, tokens, logprobs
    return run


def _rows(rng, n: int, v: int, kind: str) -> np.ndarray:
    if kind == "quantised":  # the reference chip's own logits: k/256 - 8, many ties
        return (rng.integers(0, 4096, (n, v)) / 256 - 8).astype(np.float32)
    if kind == "coarse":  # few distinct values: ties at the top and at the k-th value
        return rng.integers(-3, 3, (n, v)).astype(np.float32)
    if kind == "adjacent":  # neighbouring float32 values: the float32 division merges some, float64 would not
        return (np.float32(1.0) + rng.integers(0, 64, (n, v)).astype(np.float32) * np.float32(2.0**-23))
    if kind == "subnormal":  # gaps a temperature below 1e-30 would blow up (the host clamps it to 1e-30)
        return (rng.integers(0, 4, (n, v)) * 1e-38).astype(np.float32)
    if kind == "minus_inf":
        z = (rng.standard_normal((n, v)) * 2).astype(np.float32)
        z[rng.random((n, v)) < 0.7] = -np.inf
        z[:, 0] = 0.0  # every row keeps a finite maximum
        return z
    if kind == "long_tail":  # one strong token more than the first margin above a long tail
        z = np.tile(np.concatenate([[0.0], np.linspace(-9.0, -9.5, v - 1)]).astype(np.float32), (n, 1))
        return z + rng.integers(0, 3, (n, 1)).astype(np.float32) * 1e-3
    return (rng.standard_normal((n, v)) * rng.choice([0.5, 3.0, 12.0], (n, 1))).astype(np.float32)


def _params(rng, n: int, v: int):
    temperature = rng.choice([0.0, 1e-40, 1e-30, 1e-3, 0.3, 0.7, 1.0, 1.5, 3.0], n)
    top_p = rng.choice([1.0, 1.5, 0.999, 0.95, 0.9, 0.5, 0.3, 0.0], n)
    top_k = rng.choice([0, 0, -1, 1, 2, 5, 40, v - 1, v, v + 5], n)
    seed = rng.integers(0, 2**64, n, dtype=np.uint64)
    positions = rng.choice([0, 1, 17, 4095, 2**31 - 1], n) * (rng.random(n) < 0.2) + rng.integers(0, 100_000, n)
    return (temperature.astype(np.float32), top_p.astype(np.float32), top_k.astype(np.int32), seed,
            positions.astype(np.int64))


CASES = [("quantised", 320, 4000), ("coarse", 320, 1500), ("normal", 1000, 2500), ("minus_inf", 200, 1500),
         ("long_tail", 1500, 300), ("adjacent", 300, 1500),
         ("subnormal", 100, 1000), ("normal", 7, 1500), ("normal", 20_000, 40)]


@pytest.mark.parametrize("kind,vocab,n", CASES)
def test_the_c_sampler_draws_the_host_samplers_tokens(c_sample, kind, vocab, n):
    rng = np.random.default_rng(zlib.crc32(f"{kind} {vocab}".encode()))
    z = _rows(rng, n, vocab, kind)
    params = _params(rng, n, vocab)
    host_tokens, host_logprobs = sample(z, *params)
    rc, tokens, logprobs = c_sample(z, *params)
    assert rc == 0
    differ = np.flatnonzero(tokens != host_tokens)
    assert differ.size == 0, [(int(i), int(tokens[i]), int(host_tokens[i]), *(float(p[i]) for p in params[:3]))
                              for i in differ[:5]]
    np.testing.assert_allclose(logprobs, host_logprobs, rtol=1e-5, atol=1e-5)
    sampled = (params[0] > 0) & (params[2] != 1)
    assert len(set(tokens[sampled].tolist())) > min(5, vocab - 1)  # the rows really were sampled, not argmaxed


def test_ties_at_the_kth_value_go_to_the_lower_ids(c_sample):
    z = np.zeros((2000, 50), np.float32)
    z[:, 10] = 1.0  # then 49 tokens tied at 0: top_k = 3 keeps 10, 0 and 1
    n = len(z)
    args = (np.full(n, 5.0, np.float32), np.ones(n, np.float32), np.full(n, 3, np.int32),
            np.arange(n, dtype=np.uint64), np.arange(n, dtype=np.int64))
    host, _ = sample(z, *args)
    rc, dev, _ = c_sample(z, *args)
    assert rc == 0 and set(host.tolist()) == set(dev.tolist()) == {0, 1, 10}
    assert np.array_equal(host, dev)


def test_bad_rows_and_parameters_fail_the_call(c_sample):
    z = np.zeros((2, 8), np.float32)
    ok = (np.ones(2, np.float32), np.ones(2, np.float32), np.zeros(2, np.int32), np.zeros(2, np.uint64),
          np.zeros(2, np.int64))
    assert c_sample(z, *ok)[0] == 0
    for bad_value in (np.nan, np.inf):
        bad = z.copy()
        bad[1, 3] = bad_value
        assert c_sample(bad, *ok)[0] == E_DEVICE  # the host raises ValueError on the same row
        with pytest.raises(ValueError):
            sample(bad, *ok)
    assert c_sample(np.full((2, 8), -np.inf, np.float32), *ok)[0] == E_DEVICE
    assert c_sample(z, np.array([1.0, np.nan], np.float32), *ok[1:])[0] == E_INVALID
    assert c_sample(z, ok[0], np.array([np.inf, 1.0], np.float32), *ok[2:])[0] == E_INVALID
