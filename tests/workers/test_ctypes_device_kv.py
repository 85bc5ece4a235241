"""Device-resident KV through the C ABI (the optional simpler_kv_* group of npuserve_chip.h).

A prompt prefilled on one chip is exported block by block into the board's
host slot pool (KV_EXPORT through `simpler_kv_copy_out`), imported into other
block ids of another chip (KV_IMPORT through `simpler_kv_copy_in`), and the
continuation there equals the uninterrupted run's: the same logits after
every decoded token. The same holds for a library without the group (the
worker's own paged cache), and a library exporting only part of it is
refused at load, naming what it lacks.
"""

from __future__ import annotations


import numpy as np
import pytest

from engine.core.tier_transfers import HOST, chain_words
from ipc.kv_slots import KvSlotPool, record_bytes
from ipc.records import Job, JobKind
from workers.backends.ctypes_backend import CtypesBackend, NativeLibraryError, build_reference_library
from workers.kv_transfer import HostKv

from tests.workers.test_ctypes_backend import BS, _job, decode1, expected_logits, prefill

PROMPT = [(5 * i + 11) % 300 + 2 for i in range(40)]  # 2 full blocks and 8 tokens of a third
SRC_TABLE, DST_TABLE = [3, 7, 1], [12, 0, 9]


@pytest.fixture(scope="module", params=["device-kv", "host-kv"])
def library(tmp_path_factory, request):
    d = tmp_path_factory.mktemp("devkv")
    if request.param == "device-kv":
        return str(build_reference_library(d))
    return str(build_reference_library(d, name="libref_host.so", defines={"REF_DEVICE_KV": 0}))


def _chip(library: str, chip_id: int) -> CtypesBackend:
    b = CtypesBackend(library=library, chip_id=chip_id, block_size=BS, num_blocks=16)
    b.load(None)
    return b


def _kv_job(kind: JobKind, src, dst) -> Job:
    job = Job.kv_copy(9, 1, src, dst, kind=kind)
    job.tokens = chain_words([bytes([i + 1]) * 16 for i in range(len(src))])
    job.positions = np.full(len(src), HOST, np.int32)
    return Job.from_arrays(job.to_arrays())  # as read from the ring


def _continue(chip, table, n: int) -> list[np.ndarray]:
    """Greedy decode of n tokens after PROMPT on `table`; the logits after each."""
    history, out = list(PROMPT), []
    logits = expected_logits(history)
    for _ in range(n):
        tok = int(np.argmax(logits))
        logits = decode1(chip, tok, len(history), table)
        history.append(tok)
        out.append(logits)
    return out


def test_export_import_through_the_abi_gives_the_same_continuation(library):
    a, b = _chip(library, 3), _chip(library, 4)
    assert a.device_kv == ("libref_host" not in library)
    np.testing.assert_array_equal(prefill(a, PROMPT, 0, SRC_TABLE), expected_logits(PROMPT))
    info = a.describe()
    pool = KvSlotPool.create("npuservetest", "devkv", 4, record_bytes(info.kv.block_bytes()))
    try:
        HostKv(pool, a, info).run(_kv_job(JobKind.KV_EXPORT, SRC_TABLE, [0, 1, 2]))
        HostKv(pool, b, b.describe()).run(_kv_job(JobKind.KV_IMPORT, [0, 1, 2], DST_TABLE))
    finally:
        pool.close()
        pool.unlink()
    moved = _continue(b, DST_TABLE + [5], 20)  # runs into a fourth block on the importing chip
    uninterrupted = _continue(a, SRC_TABLE + [2], 20)
    for x, y in zip(moved, uninterrupted):
        np.testing.assert_array_equal(x, y)


def test_a_block_the_abi_refuses_writes_nothing(library):
    chip = _chip(library, 5)
    prefill(chip, PROMPT[:BS], 0, [2])
    before = chip.swap_out(np.arange(16))
    with pytest.raises(ValueError):
        chip.swap_in(np.array([2, 99]), before[:2])  # an id outside the pool
    np.testing.assert_array_equal(chip.swap_out(np.arange(16)), before)
    chip.copy_blocks(np.array([2]), np.array([6]))  # copy-on-write of a shared block (through the host)
    np.testing.assert_array_equal(decode1(chip, 4, BS, [6, 8]), expected_logits(PROMPT[:BS] + [4]))


def test_a_library_with_part_of_the_group_is_refused(tmp_path):
    # the host-KV reference library plus two of the group's six calls: not device-resident KV
    lib = build_reference_library(tmp_path, name="libhalf.so", defines={"REF_DEVICE_KV": 0}, extra_source=(
        "int64_t simpler_kv_block_bytes(int c, int b) { return 16 * b; }\n"
        "int simpler_kv_init(int c, int n, int b) { return 0; }\n"))
    with pytest.raises(NativeLibraryError, match="libhalf.so.*part of the device-resident KV.*"
                                                 "simpler_kv_copy_out.*simpler_model_decode_paged"):
        CtypesBackend(library=str(lib))
