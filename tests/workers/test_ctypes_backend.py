"""The ctypes backend against workers/native/reference_chip.c, compiled per test session."""

from __future__ import annotations

import hashlib
import shutil
import subprocess

import numpy as np
import pytest

from ipc.records import Job, JobKind
from workers.backends.base import BackendError
from workers.backends.ctypes_backend import (
    ABI_VERSION,
    HEADER,
    CtypesBackend,
    NativeLibraryError,
    build_reference_library,
)
from workers.backends.registry import make_backend



def test_a_c_compiler_is_installed():
    """The ctypes backend is a promised part (docs/backends.md): without `cc` these tests fail, never skip."""
    assert shutil.which("cc"), "no C compiler: install one (e.g. apt-get install gcc) to build reference_chip.c"

BS = 16
VOCAB = 320
M32 = 0xFFFFFFFF


# -- Python re-statement of reference_chip.c ---------------------------------------------------


def mix32(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def history_hash(tokens: list[int]) -> int:
    h = 0x811C9DC5
    for t in tokens:
        h = mix32(h * 0x01000193 + t + 1)
    return h


def expected_logits(history: list[int]) -> np.ndarray:
    h = history_hash(history)
    return np.array(
        [((mix32(h ^ ((v * 0x9E3779B9) & M32)) >> 16) & 0xFFF) / 256.0 - 8.0 for v in range(VOCAB)],
        dtype=np.float32,
    )


# -- fixtures and job builders ------------------------------------------------------------------


@pytest.fixture(scope="module")
def libdir(tmp_path_factory):
    return tmp_path_factory.mktemp("chiplib")


@pytest.fixture(scope="module", params=["device-kv", "host-kv"])
def library(libdir, request):
    """The reference library with its device-resident KV group and without it: every test runs on both."""
    if request.param == "device-kv":
        return str(build_reference_library(libdir))
    return str(build_reference_library(libdir, name="libreference_hostkv.so", defines={"REF_DEVICE_KV": 0}))


@pytest.fixture
def chip(library):
    backend = CtypesBackend(library=library, chip_id=1, block_size=BS, num_blocks=32)
    backend.load(None)
    return backend


def _job(kind: JobKind, lanes: list[tuple[list[int], int, list[int]] | None], m: int = 8) -> Job:
    """lanes[i] = None or (new tokens, first position, block table)."""
    b = len(lanes)
    toks, poss, qs = [], [], [0]
    ctx = np.zeros(b, np.int32)
    valid = np.zeros(b, np.uint8)
    tables = np.full((b, m), -1, np.int32)
    for i, lane in enumerate(lanes):
        if lane is not None:
            t, start, table = lane
            toks += t
            poss += list(range(start, start + len(t)))
            ctx[i] = start + len(t)
            valid[i] = 1
            tables[i, : len(table)] = table
        qs.append(len(toks))
    job = Job(
        job_id=7, generation=0, kind=kind, tokens=np.array(toks, np.int32), positions=np.array(poss, np.int32),
        query_start=np.array(qs, np.int32), lane_valid=valid, context_lens=ctx, block_tables=tables,
        sample=valid.copy(), temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32),
        top_k=np.zeros(b, np.int32), seed=np.zeros(b, np.uint64), want_logprobs=np.zeros(b, np.uint8),
    )
    job.validate()
    return job


def prefill(chip, tokens, start, table):
    return chip.prefill(_job(JobKind.PREFILL, [(tokens, start, table)])).logits[0]


def decode1(chip, token, pos, table):
    return chip.decode(_job(JobKind.DECODE, [([token], pos, table)])).logits[0]


PROMPT = [(7 * i + 3) % VOCAB for i in range(37)]  # spans 3 blocks of 16
TABLE = [9, 2, 30, 5]  # deliberately scattered physical blocks


# -- behaviour --------------------------------------------------------------------------------


def test_describe_comes_from_the_library(chip, library):
    info = chip.describe()
    assert info.name == "ctypes" and info.vocab_size == VOCAB and info.eos_ids == (1,)
    assert [p.batch for p in info.profiles] == [1, 4, 8, 16] and info.max_seq == 4096
    assert info.chunked_prefill and info.kv.block_size == BS and info.kv.num_blocks == 32
    assert info.extra["kv_bytes_per_token"] == 16 and info.extra["library"] == library
    assert chip.device_kv == ("hostkv" not in library) == info.extra["device_kv"]
    assert info.model_sha256 == hashlib.sha256(open(library, "rb").read()).hexdigest()
    assert ABI_VERSION == 1 and "#define SIMPLER_ABI_VERSION 1" in HEADER.read_text()


def test_prefill_then_decode_round_trips_kv_through_the_paged_cache(chip):
    np.testing.assert_array_equal(prefill(chip, PROMPT, 0, TABLE), expected_logits(PROMPT))
    history = list(PROMPT)
    for _ in range(12):  # crosses the block boundary at position 48
        tok = int(np.argmax(expected_logits(history)))
        logits = decode1(chip, tok, len(history), TABLE)
        history.append(tok)
        np.testing.assert_array_equal(logits, expected_logits(history))
    # the KV entries sit in the table's blocks at position % block_size, in order
    entries = chip.swap_out(np.array(TABLE)).reshape(-1, 16).view(np.int32)[: len(history)]
    assert entries[:, 1].tolist() == history and entries[:, 2].tolist() == list(range(len(history)))


def test_decode_depends_on_the_prompt_held_in_kv(chip):
    prefill(chip, PROMPT, 0, [0, 1, 3])
    other = [PROMPT[0] + 1] + PROMPT[1:]
    prefill(chip, other, 0, [4, 6, 7])
    a = decode1(chip, 11, len(PROMPT), [0, 1, 3])
    b = decode1(chip, 11, len(PROMPT), [4, 6, 7])
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(b, expected_logits(other + [11]))


@pytest.mark.parametrize("split", [1, 15, 16, 17, 32, 36])
def test_chunked_prefill_equals_one_shot(chip, split):
    one = prefill(chip, PROMPT, 0, [0, 1, 2])
    prefill(chip, PROMPT[:split], 0, [3, 4, 5])
    two = prefill(chip, PROMPT[split:], split, [3, 4, 5])
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(chip.swap_out(np.array([0, 1, 2])), chip.swap_out(np.array([3, 4, 5])))


def test_prefix_blocks_shared_by_two_sequences(chip):
    a_tail, b_tail = [5, 6, 7], [8, 9]
    prefill(chip, PROMPT[:16] + a_tail, 0, [10, 11])
    shared_before = chip.swap_out(np.array([10])).copy()
    # sequence B reuses block 10 for its first 16 tokens and prefills only its tail
    got = prefill(chip, b_tail, 16, [10, 12])
    np.testing.assert_array_equal(got, expected_logits(PROMPT[:16] + b_tail))
    np.testing.assert_array_equal(chip.swap_out(np.array([10])), shared_before)
    np.testing.assert_array_equal(decode1(chip, 4, 19, [10, 11]), expected_logits(PROMPT[:16] + a_tail + [4]))


def test_batched_decode_with_an_inactive_lane(chip):
    prompts = {0: PROMPT[:5], 2: PROMPT[3:20], 3: PROMPT[:33]}
    tables = {0: [20], 2: [21, 22], 3: [23, 24, 25]}
    for lane, p in prompts.items():
        prefill(chip, p, 0, tables[lane])
    untouched = chip.swap_out(np.arange(26, 32)).copy()
    lanes = [([40 + lane], len(prompts[lane]), tables[lane]) if lane in prompts else None for lane in range(4)]
    logits = chip.decode(_job(JobKind.DECODE, lanes)).logits
    assert logits.shape == (4, VOCAB) and not logits[1].any()
    for lane, p in prompts.items():
        np.testing.assert_array_equal(logits[lane], expected_logits(p + [40 + lane]))
    np.testing.assert_array_equal(chip.swap_out(np.arange(26, 32)), untouched)


def test_swap_out_in_and_copy_blocks_preserve_kv(chip):
    prefill(chip, PROMPT[:20], 0, [1, 2])
    saved = chip.swap_out(np.array([1, 2]))
    chip.swap_in(np.array([1, 2]), np.zeros_like(saved))
    with pytest.raises(BackendError, match="SIMPLER_E_KV_CORRUPT"):
        decode1(chip, 3, 20, [1, 2])  # the library really reads the KV from the cache
    chip.swap_in(np.array([1, 2]), saved)
    np.testing.assert_array_equal(decode1(chip, 3, 20, [1, 2]), expected_logits(PROMPT[:20] + [3]))
    chip.copy_blocks(np.array([1, 2]), np.array([14, 15]))
    np.testing.assert_array_equal(decode1(chip, 3, 20, [14, 15]), expected_logits(PROMPT[:20] + [3]))
    with pytest.raises(ValueError):
        chip.swap_in(np.array([1]), saved)


def test_library_errors_become_backend_errors(chip):
    with pytest.raises(BackendError, match="simpler_model_prefill.*SIMPLER_E_INVALID"):
        prefill(chip, [1, VOCAB + 5], 0, [0])  # token outside the vocabulary
    with pytest.raises(BackendError, match="SIMPLER_E_KV_CORRUPT"):
        decode1(chip, 2, 4, [31])  # block 31 never written


def test_bad_block_tables_are_rejected_before_the_call(chip):
    with pytest.raises(ValueError, match="block table"):
        prefill(chip, PROMPT, 0, [0])  # 37 tokens need 3 blocks
    with pytest.raises(ValueError, match="outside"):
        prefill(chip, PROMPT[:4], 0, [32])
    prefill(chip, PROMPT[:16], 0, [6])
    before = chip.swap_out(np.arange(32)).copy()
    with pytest.raises(ValueError, match="outside"):
        prefill(chip, PROMPT[16:20], 16, [6, 40])  # prefix fine, new tokens' block invalid
    with pytest.raises(ValueError, match="outside"):
        chip.decode(_job(JobKind.DECODE, [([4], 16, [6, 8]), ([4], 16, [6, -1])]))
    np.testing.assert_array_equal(chip.swap_out(np.arange(32)), before)  # nothing half-written


def test_calls_before_load_fail(library):
    backend = CtypesBackend(library=library)
    with pytest.raises(BackendError, match="no model loaded"):
        prefill(backend, [1, 2], 0, [0])


def test_registry_builds_the_ctypes_backend(library):
    backend = make_backend("ctypes", library=library, chip_id=2, num_blocks=4)
    assert isinstance(backend, CtypesBackend) and backend.describe().kv.num_blocks == 4


# -- startup errors ----------------------------------------------------------------------------


def test_missing_library_names_the_path(tmp_path):
    path = str(tmp_path / "libnothere.so")
    with pytest.raises(NativeLibraryError, match="libnothere.so"):
        CtypesBackend(library=path)


def test_a_file_that_is_not_a_library(tmp_path):
    path = tmp_path / "libjunk.so"
    path.write_text("not an ELF file")
    with pytest.raises(NativeLibraryError, match="libjunk.so"):
        CtypesBackend(library=str(path))


def test_missing_symbol_is_named(tmp_path):
    src = tmp_path / "partial.c"
    src.write_text(
        f'#include "{HEADER}"\n'
        "int simpler_abi_version(void) { return SIMPLER_ABI_VERSION; }\n"
        "int simpler_model_describe(int c, simpler_model_info* o) { return SIMPLER_E_DEVICE; }\n"
        "int simpler_model_prefill(int c, const int32_t* t, int n, const void* i, size_t s, void* o,"
        " float* l, int v) { return SIMPLER_E_DEVICE; }\n"
    )
    lib = tmp_path / "libpartial.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(NativeLibraryError, match="libpartial.so.*simpler_model_decode"):
        CtypesBackend(library=str(lib))


def test_wrong_abi_version_is_named(libdir):
    lib = build_reference_library(libdir, name="libabi2.so", defines={"SIMPLER_ABI_VERSION": 2})
    with pytest.raises(NativeLibraryError, match="libabi2.so.*version 2.*needs 1"):
        CtypesBackend(library=str(lib))
