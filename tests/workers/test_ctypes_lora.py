"""LoRA adapters through the C ABI (the optional simpler_lora_* group), on the reference chip library.

The reference chip mixes an adapter's key (a hash of its bytes) into each
step of a lane's running hash, so adapter lanes get their own logits, and KV
written under one adapter fails the device's own check when read under
another. Expected logits come from the Python re-statement of the library.
"""

from __future__ import annotations

import numpy as np
import pytest

from ipc.records import JobKind
from tests.workers.test_ctypes_backend import BS, M32, VOCAB, _job, mix32
from workers.backends.base import BackendError
from workers.backends.ctypes_backend import CtypesBackend, NativeLibraryError, build_reference_library
from workers.lora.maker import make_lora
from workers.model_maker import make_model

PROMPT = [(7 * i + 3) % VOCAB for i in range(21)]


def _key(data: bytes) -> int:
    h = 0x811C9DC5
    for byte in data:
        h = mix32((h * 0x01000193 + byte) & M32)
    return h or 1


def _logits(history: list[int], key: int) -> np.ndarray:
    h = 0x811C9DC5
    for t in history:
        h = mix32((h * 0x01000193 + t + 1 + key * 0x27D4EB2F) & M32)
    return np.array([((mix32(h ^ ((v * 0x9E3779B9) & M32)) >> 16) & 0xFFF) / 256.0 - 8.0 for v in range(VOCAB)],
                    np.float32)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctl")
    base = make_model(str(root / "base"), vocab=VOCAB, max_seq=128, kv_num_blocks=8, golden_cases=1)
    return [make_lora(base, str(root / f"a{i}"), rank=2, seed=i) for i in range(2)]


@pytest.fixture(scope="module", params=["device-kv", "host-kv"])
def chip(tmp_path_factory, request, adapters):
    d = tmp_path_factory.mktemp("ctlib")
    lib = build_reference_library(d, defines={} if request.param == "device-kv" else {"REF_DEVICE_KV": 0})
    b = CtypesBackend(library=str(lib), chip_id=3, block_size=BS, num_blocks=32)
    b.load(None)
    data = [b.read_adapter(p, "") for p in adapters]
    for slot, blob in enumerate(data):
        b.load_adapter(slot, blob)
    return b, [_key(x) for x in data]


def _with(job, slots):
    job.adapter = np.asarray(slots, np.int32)
    return job


def test_the_library_declares_its_slots(chip):
    b, _ = chip
    assert b.describe().extra["lora"] == {"slots": 8, "mixed": True}


def test_lanes_of_two_adapters_and_the_base_share_a_decode_job_each_with_its_own_logits(chip):
    b, keys = chip
    tables = [[0, 1], [2, 3], [4, 5]]
    slots = [0, -1, 1]
    for lane, slot in enumerate(slots):
        out = b.prefill(_with(_job(JobKind.PREFILL, [(PROMPT, 0, tables[lane])]), [slot])).logits[0]
        assert np.array_equal(out, _logits(PROMPT, 0 if slot < 0 else keys[slot]))
    job = _with(_job(JobKind.DECODE, [([5], len(PROMPT), t) for t in tables] + [None]), slots + [-1])
    out = b.decode(job).logits
    for lane, slot in enumerate(slots):
        assert np.array_equal(out[lane], _logits(PROMPT + [5], 0 if slot < 0 else keys[slot]))
    assert not np.array_equal(out[0], out[1]) and not np.array_equal(out[0], out[2])


def test_kv_written_under_one_adapter_fails_the_device_check_under_another(chip):
    b, _ = chip
    table = [8, 9]
    b.prefill(_with(_job(JobKind.PREFILL, [(PROMPT, 0, table)]), [0]))
    with pytest.raises(BackendError, match="KV_CORRUPT"):
        b.decode(_with(_job(JobKind.DECODE, [([5], len(PROMPT), table)]), [1]))
    with pytest.raises(BackendError, match="KV_CORRUPT"):
        b.decode(_job(JobKind.DECODE, [([5], len(PROMPT), table)]))  # nor the base model
    b.decode(_with(_job(JobKind.DECODE, [([5], len(PROMPT), table)]), [0]))  # its own adapter reads it


def test_a_slot_without_an_adapter_is_refused_before_anything_runs(chip):
    b, _ = chip
    with pytest.raises(ValueError, match=r"slot\(s\) \[5\] hold no adapter"):
        b.prefill(_with(_job(JobKind.PREFILL, [(PROMPT, 0, [10, 11])]), [5]))
    b.load_adapter(6, b"x" * 10)
    b.unload_adapter(6)
    with pytest.raises(ValueError, match="hold no adapter"):
        b.decode(_with(_job(JobKind.DECODE, [([5], len(PROMPT), [0, 1])]), [6]))


def test_a_library_without_the_group_serves_no_adapters(tmp_path, adapters):
    lib = build_reference_library(tmp_path, defines={"REF_LORA": 0})
    b = CtypesBackend(library=str(lib), block_size=BS, num_blocks=8)
    assert "lora" not in b.describe().extra
    with pytest.raises(BackendError, match="not supported"):
        b.read_adapter(adapters[0], "")
    partial = build_reference_library(tmp_path, name="libpartial.so", defines={"REF_LORA": 0},
                                      extra_source="int simpler_lora_slots(int c) { return 4; }")
    with pytest.raises(NativeLibraryError, match="part of the LoRA group; it lacks: simpler_lora_load"):
        CtypesBackend(library=str(partial), block_size=BS, num_blocks=8)
