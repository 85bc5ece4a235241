"""The worker's draft model (ref backend, tiny make-model packages sharing a vocabulary): proposals, mirrored KV."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import JobKind, JobStatus, Lane, build_job
from workers.backends.ref import RefBackend, full_recompute_logits
from workers.draft_model import DraftModel
from workers.execute_job import execute_job
from workers.model_maker import make_model
from workers.package_loader import load_package


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkgs")
    target = load_package(make_model(str(root / "t"), max_seq=128, kv_num_blocks=32, seed=21))
    small = load_package(make_model(str(root / "d"), max_seq=128, kv_num_blocks=32, seed=22))
    return target, small


def _pair(target_pkg, draft_pkg):
    t, d = RefBackend(), RefBackend(num_blocks=target_pkg.kv_num_blocks)
    t.load(target_pkg)
    d.load(draft_pkg)
    return t, DraftModel(d)


def _greedy(pkg, seq: list[int], n: int) -> list[int]:
    out = list(seq)
    for _ in range(n):
        out.append(int(full_recompute_logits(pkg, out)[-1].argmax()))
    return out[len(seq):]


@pytest.mark.parametrize("self_draft", [True, False])
def test_draft_model_proposals_are_verified_and_kv_mirrored(packages, self_draft) -> None:
    target_pkg, small = packages
    draft_pkg = target_pkg if self_draft else small
    t, draft = _pair(target_pkg, draft_pkg)
    prompt = [256] + list(range(5, 25))
    # the prompt: one job, mirrored on the draft
    res = execute_job(t, build_job(JobKind.PREFILL, [Lane(prompt, 0, [0, 1, 2])]), draft=draft)
    assert res.status is JobStatus.OK
    want = _greedy(target_pkg, prompt, 12)
    assert int(res.tokens[0]) == want[0]
    seq = prompt + [want[0]]
    emitted = [want[0]]
    steps = 0
    while len(emitted) < 12:
        k = min(4, 12 - len(emitted))
        start = len(seq) - 1
        job = build_job(JobKind.PREFILL, [Lane([seq[-1]] + [seq[-1]] * k, start, [0, 1, 2], drafts=k, draft_model=True)])
        res = execute_job(t, job, draft=draft)
        assert res.status is JobStatus.OK
        a = int(res.accepted[0])
        run = res.accepted_tokens.tolist() + [int(res.tokens[0])]
        assert len(run) == a + 1
        seq += run
        emitted += run
        steps += 1
    assert emitted[:12] == want  # token for token the target's greedy output
    if self_draft:
        assert steps <= 3  # drafting for itself: every draft accepted (12 tokens in 3 steps of 4)
    # the draft's KV equals a draft run over the same tokens (mirrored, rolled-back slots rewritten)
    probe = execute_job(draft.backend, build_job(JobKind.PREFILL, [Lane([seq[-1]], len(seq) - 1, [0, 1, 2])]))
    ref = full_recompute_logits(draft_pkg, seq)[-1]
    got = draft.backend.prefill(build_job(JobKind.PREFILL, [Lane([seq[-1]], len(seq) - 1, [0, 1, 2])])).logits[0]
    assert probe.status is JobStatus.OK and np.abs(got - ref).max() < 1e-4
