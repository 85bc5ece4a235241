"""Speculative verification on the llamacpp backend (tiny model as GGUF): draft rows and the KV rollback."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import JobKind, Lane, build_job
from workers.backends.llamacpp import LlamacppBackend
from workers.backends.ref import full_recompute_logits
from workers.default_package import ensure_default_gguf_package, ensure_default_package
from workers.package_loader import load_package

ATOL = 2e-2  # float16 K/V in llama.cpp vs the float32 oracle (as in test_llamacpp_backend)
BS = 16


@pytest.fixture(scope="module")
def npz():
    return load_package(ensure_default_package())


@pytest.fixture
def backend():
    b = LlamacppBackend(threads=1, max_sequences=8)
    b.load(load_package(ensure_default_gguf_package()))
    yield b
    b.unload()


def _prompt(seed: int, n: int) -> list[int]:
    return [256] + np.random.default_rng(seed).integers(0, 256, n - 1).tolist()


def test_describe_declares_verification(backend):
    assert backend.describe().extra["spec_verify"] is True


@pytest.mark.parametrize("accepted_len", [21, 32])  # mid-block, and exactly on a block boundary
def test_draft_rows_match_recompute_and_rejected_cells_roll_back(backend, npz, accepted_len):
    seq = _prompt(5, 40)
    other = _prompt(6, 9)
    n0 = accepted_len - 3
    backend.prefill(build_job(JobKind.PREFILL, [Lane(seq[:n0], 0, [0, 1, 2])]))
    backend.prefill(build_job(JobKind.PREFILL, [Lane(other, 0, [5])]))
    # verification: last token + 6 drafts (3 right, 3 wrong), beside a plain decode lane
    wrong = [(t + 1) % 256 for t in seq[accepted_len:accepted_len + 3]]
    drafts = seq[n0:accepted_len] + wrong
    job = build_job(JobKind.PREFILL, [Lane([other[-1] + 1], 9, [5]),
                                      Lane([seq[n0 - 1]] + drafts[:6], n0 - 1, [0, 1, 2], drafts=6)])
    out = backend.prefill(job)
    assert out.draft_logits is not None and out.draft_logits.shape[0] == 6
    full = full_recompute_logits(npz, seq[:n0 - 1] + [seq[n0 - 1]] + drafts[:6])
    assert np.abs(out.draft_logits - full[n0 - 1:n0 + 5]).max() < ATOL
    assert np.abs(out.logits[1] - full[-1]).max() < ATOL
    # the next job starts at the accepted length: the rejected drafts' cells must be gone
    nxt = backend.prefill(build_job(JobKind.PREFILL, [Lane(seq[accepted_len:accepted_len + 2], accepted_len,
                                                          [0, 1, 2])])).logits[0].copy()
    assert np.abs(nxt - full_recompute_logits(npz, seq[:accepted_len + 2])[-1]).max() < ATOL
