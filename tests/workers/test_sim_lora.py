"""The sim backend's adapters: what a job with adapter lanes and a swap cost the modelled device.

Deterministic: the modelled device is kept busy far into the future, so a job
ends exactly its modelled time after the queue (no clock is read to compare).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ipc.records import JobKind
from workers.backends.base import BackendError
from workers.backends.sim import SimBackend
from workers.lora.maker import make_lora
from workers.model_maker import make_model
from workers.package_loader import load_package

from test_stub_sim_backends import decode_lane, make_job

FAR = time.monotonic() + 3600.0  # the device queue ends here: every job is modelled after it


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim-lora")
    base = make_model(str(root / "base"), max_seq=64, kv_num_blocks=8, golden_cases=0)
    other = make_model(str(root / "other"), layers=3, max_seq=64, kv_num_blocks=8, golden_cases=0)
    return (base, make_lora(base, str(root / "r4"), rank=4, targets=["wq", "wv"], seed=1),
            make_lora(base, str(root / "r8"), rank=8, targets=["wq", "wk", "wv"], seed=2),
            make_lora(other, str(root / "other-lora"), rank=2, seed=3))


def _sim(base: str) -> SimBackend:
    b = SimBackend(time_scale=1.0, lora_slots=2)
    b.load(load_package(base))
    b._wait_until = lambda deadline: None  # the modelled end is what is checked, not slept
    return b


def _decode_end(b: SimBackend, adapter: list[int]) -> float:
    job = make_job(JobKind.DECODE, [decode_lane(i, 4) for i in range(len(adapter))])
    job.adapter = np.array(adapter, np.int32)
    b._device_free_at = FAR
    b.decode(job)
    return b._device_free_at - FAR


def test_a_job_pays_one_launch_and_each_adapter_lane_its_gather(adapters):
    base, r4, r8, _ = adapters
    b = _sim(base)
    b.load_adapter(0, b.read_adapter(r4, ""))
    b.load_adapter(1, b.read_adapter(r8, ""))
    assert b.adapter_sizes == [8, 24]  # rank x targets
    plain = _decode_end(b, [-1, -1, -1])
    assert plain == pytest.approx(b.decode_seconds(3), abs=1e-9)
    mixed = _decode_end(b, [0, -1, 1])  # two adapters and the base in one job
    per_rank = b.lora.bytes_per_rank / (b.lora.device_gbps * 1e9)
    assert mixed - plain == pytest.approx(b.lora.step_ms / 1000 + (8 + 24) * per_rank, abs=1e-9)
    assert _decode_end(b, [1, 1, 1]) - plain == pytest.approx(b.lora.step_ms / 1000 + 3 * 24 * per_rank, abs=1e-9)


def test_a_swap_occupies_the_device_for_the_adapters_copy(adapters):
    base, _, r8, _ = adapters
    b = _sim(base)
    b._device_free_at = FAR
    b.load_adapter(0, b.read_adapter(r8, ""))
    assert b._device_free_at - FAR == pytest.approx(
        b.lora.load_base_ms / 1000 + 24 * b.lora.bytes_per_rank / (b.lora.transfer_gbps * 1e9), abs=1e-9)


def test_an_empty_slot_a_changed_manifest_or_another_bases_adapter_is_refused(adapters):
    base, r4, _, other = adapters
    b = _sim(base)
    with pytest.raises(ValueError, match="holds no adapter"):
        _decode_end(b, [0])
    with pytest.raises(BackendError, match="changed"):
        b.read_adapter(r4, "0" * 64)
    with pytest.raises(Exception, match="layers"):
        b.read_adapter(other, "")
    with pytest.raises(BackendError, match="slot 2"):
        b.load_adapter(2, 8)
