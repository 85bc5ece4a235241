"""The worker process driven through real rings and sockets by a ChipLink.

Every test uses its own board id so that the shared-memory check only looks
at objects this test created, even with other suites running beside it.
Expected results come from calling the backend in-process and sampling each
lane on its own -- never from the worker's own job code.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import psutil
import pytest
import zmq

from ipc.lane_imports import CAPABILITY as LANE_IMPORTS
from ipc.records import Job, JobKind, JobResult, JobStatus
from ipc.ring import RingFull
from ipc.stale import reap_stale
from workers.backends.registry import make_backend
from engine.daemon.chip_link import ChipLink, Heartbeat, Ready, Result, WorkerFailed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HB = 0.05  # heartbeat interval used by these tests
ORPHAN_PREFIX = "nptorphan"
_boards = itertools.count()


def shm_entries(board: str) -> set[str]:
    return {e for e in os.listdir("/dev/shm") if f"-{board}-" in e}


@pytest.fixture
def board():
    """A board id unique to this test; asserts the test leaves no shm of it behind."""
    b = f"wt{os.getpid()}n{next(_boards)}"
    assert shm_entries(b) == set()
    yield b
    assert shm_entries(b) == set(), "shared memory outlived the test"


@pytest.fixture
def runtime_dir():
    d = tempfile.mkdtemp(prefix="nw", dir="/tmp")
    yield d
    leftovers = os.listdir(d)
    shutil.rmtree(d, ignore_errors=True)
    assert leftovers == [], f"runtime files left behind: {leftovers}"


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def make_link(ctx, board, runtime_dir, backend="stub", **kw) -> ChipLink:
    return ChipLink(ctx=ctx, board=board, chip=0, backend=backend, runtime_dir=runtime_dir,
                    heartbeat_interval_s=HB, **kw)


def link_poller(link: ChipLink) -> zmq.Poller:
    """A poller on what the daemon polls for a link: its socket and its result doorbell."""
    poller = zmq.Poller()
    poller.register(link.socket, zmq.POLLIN)
    poller.register(link.result_fd, zmq.POLLIN)
    return poller


def collect(link: ChipLink, until, timeout: float = 20.0) -> list:
    """Poll the link, gathering events until `until(events)` holds."""
    events: list = []
    poller = link_poller(link)
    deadline = time.monotonic() + timeout
    while not until(events):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out; events so far: {events[-5:]}")
        poller.poll(min(100, int(left * 1000) + 1))
        events.extend(link.handle_events())
    return events


def start_ready(link: ChipLink) -> Ready:
    link.start()
    events = collect(link, lambda ev: any(isinstance(e, (Ready, WorkerFailed)) for e in ev))
    first = next(e for e in events if isinstance(e, (Ready, WorkerFailed)))
    assert isinstance(first, Ready), first
    return first


def run_jobs(link: ChipLink, jobs: list[Job]) -> dict[int, JobResult]:
    """Submit every job (waiting for room when the ring is full); return results by job id."""
    results: dict[int, JobResult] = {}
    poller = link_poller(link)
    pending = list(jobs)
    deadline = time.monotonic() + 60
    while len(results) < len(jobs):
        assert time.monotonic() < deadline, f"only {len(results)}/{len(jobs)} results"
        assert link.is_alive(), f"worker died after {len(results)}/{len(jobs)} results"
        while pending:
            try:
                link.submit(pending[0])
            except RingFull:
                break
            pending.pop(0)
        poller.poll(100)
        for ev in link.handle_events():
            if isinstance(ev, Result):
                assert ev.result.job_id not in results, "a job was answered twice"
                results[ev.result.job_id] = ev.result
    return results


# -- the oracle: backend in-process, each lane sampled on its own --------------

def expected_result(backend, job: Job):
    """(status, tokens, logprobs, logits) of `job` run in-process, lane by lane."""
    from workers.sampling import sample

    out = backend.prefill(job) if job.kind == JobKind.PREFILL else backend.decode(job)
    tokens = np.full(job.batch, -1, np.int32)
    logprobs = np.zeros(job.batch, np.float32)
    for lane in range(job.batch):
        if not (job.lane_valid[lane] and job.sample[lane]):
            continue
        if out.logits is None:
            tokens[lane] = out.tokens[lane]
            continue
        sl = slice(lane, lane + 1)
        t, lp = sample(out.logits[sl], job.temperature[sl], job.top_p[sl], job.top_k[sl], job.seed[sl],
                       job.context_lens[sl], job.want_logprobs[sl])
        tokens[lane] = t[0]
        logprobs[lane] = lp[0]
    logits = None if (out.logits is None or not job.return_logits) else np.array(out.logits)
    return tokens, logprobs, logits


def assert_matches(res: JobResult, job: Job, exp) -> None:
    tokens, logprobs, logits = exp
    assert res.status == JobStatus.OK, (job.job_id, res.status)
    assert (res.job_id, res.generation, res.kind) == (job.job_id, job.generation, job.kind)
    np.testing.assert_array_equal(res.tokens, tokens)
    wants = (job.want_logprobs != 0) & (tokens >= 0)
    np.testing.assert_allclose(res.logprobs[wants], logprobs[wants], rtol=1e-5, atol=1e-6)
    if logits is None:
        assert res.logits is None
    else:
        assert res.logits is not None
        np.testing.assert_array_equal(res.logits, logits)


# -- job generators -------------------------------------------------------------

def _sampling(rng, b: int) -> dict:
    return dict(
        temperature=rng.choice(np.array([0.0, 0.7, 1.0], np.float32), b),
        top_p=rng.choice(np.array([1.0, 0.9, 0.5], np.float32), b),
        top_k=rng.choice(np.array([0, 1, 5, 50], np.int32), b),
        seed=rng.integers(0, 2**63, b, dtype=np.uint64),
        want_logprobs=rng.integers(0, 2, b).astype(np.uint8),
    )


def random_stub_job(rng, job_id: int) -> Job:
    """A structurally valid prefill or decode job; the stub keeps no KV."""
    if rng.random() < 0.4:
        b, valid = 1, np.ones(1, np.uint8)
        n = [int(rng.integers(1, 40))]
        kind = JobKind.PREFILL
        sample = rng.integers(0, 2, 1).astype(np.uint8)
    else:
        b = int(rng.choice([1, 4, 8, 16]))
        valid = (rng.random(b) < 0.8).astype(np.uint8)
        n = [int(v) for v in valid]
        kind = JobKind.DECODE
        sample = valid.copy()
    start = rng.integers(0, 1500, b)
    qs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    positions = np.concatenate([np.arange(s, s + k) for s, k in zip(start, n)] or [[]]).astype(np.int32)
    ctx_lens = np.array([s + k if k else 0 for s, k in zip(start, n)], np.int32)
    return Job(
        job_id=job_id, generation=3, kind=kind,
        tokens=rng.integers(0, 320, positions.size).astype(np.int32), positions=positions,
        query_start=qs, lane_valid=valid, context_lens=ctx_lens,
        block_tables=rng.integers(0, 4096, (b, 8)).astype(np.int32), sample=sample,
        return_logits=bool(rng.random() < 0.3), **_sampling(rng, b),
    )


# -- tests ------------------------------------------------------------------------

def test_thousand_mixed_stub_jobs_equal_in_process_calls(ctx, board, runtime_dir):
    rng = np.random.default_rng(1)
    jobs = [random_stub_job(rng, i) for i in range(1000)]
    oracle = make_backend("stub")
    oracle.load(None)
    with make_link(ctx, board, runtime_dir, ring_bytes=1 << 18) as link:  # small ring: exercises RingFull
        ready = collect(link, lambda ev: any(isinstance(e, Ready) for e in ev))
        want = oracle.describe()
        if want.kv_transfer is not None:  # the worker's own: it runs tier imports carried in prefill jobs
            want.extra[LANE_IMPORTS] = True
        assert [e for e in ready if isinstance(e, Ready)][0].info == want
        results = run_jobs(link, jobs)
    assert sorted(results) == list(range(1000))
    batches = {j.batch for j in jobs if j.kind == JobKind.DECODE}
    assert batches == {1, 4, 8, 16}
    for job in jobs:
        assert_matches(results[job.job_id], job, expected_result(oracle, job))


def test_kv_copy_job_is_answered(ctx, board, runtime_dir):
    with make_link(ctx, board, runtime_dir) as link:
        results = run_jobs(link, [Job.kv_copy(7, 1, [1, 2], [3, 4]), Job.kv_copy(8, 1, [1], [99999])])
    assert results[7].status == JobStatus.OK and results[7].kind == JobKind.KV_COPY
    assert results[8].status == JobStatus.FAILED  # block id beyond the stub's 4096


def test_failing_backend_call_fails_that_job_and_worker_keeps_serving(ctx, board, runtime_dir):
    rng = np.random.default_rng(2)
    good = random_stub_job(rng, 1)
    # max_seq=2048: a lane at position 5000 makes the stub raise inside decode().
    bad = Job(job_id=2, generation=0, kind=JobKind.DECODE, tokens=np.array([5], np.int32),
              positions=np.array([5000], np.int32), query_start=np.array([0, 1], np.int32),
              lane_valid=np.ones(1, np.uint8), context_lens=np.array([5001], np.int32),
              block_tables=np.zeros((1, 1), np.int32), sample=np.ones(1, np.uint8),
              temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32),
              top_k=np.zeros(1, np.int32), seed=np.zeros(1, np.uint64), want_logprobs=np.zeros(1, np.uint8))
    invalid = Job.from_arrays(bad.to_arrays())
    invalid.job_id = 3
    invalid.context_lens = np.array([7], np.int32)  # not last position + 1
    after = random_stub_job(rng, 4)
    oracle = make_backend("stub")
    oracle.load(None)
    with make_link(ctx, board, runtime_dir) as link:
        results = run_jobs(link, [good, bad, invalid, after])
        assert link.is_alive()
    assert results[2].status == JobStatus.FAILED
    np.testing.assert_array_equal(results[2].tokens, [-1])
    assert results[3].status == JobStatus.INVALID
    assert_matches(results[1], good, expected_result(oracle, good))
    assert_matches(results[4], after, expected_result(oracle, after))


def test_unknown_backend_reports_worker_failed(ctx, board, runtime_dir):
    with make_link(ctx, board, runtime_dir, backend="no_such_chip") as link:
        events = collect(link, lambda ev: any(isinstance(e, (Ready, WorkerFailed)) for e in ev))
        failed = [e for e in events if isinstance(e, WorkerFailed)]
        assert failed and "no_such_chip" in failed[0].message
        assert not any(isinstance(e, Ready) for e in events)
        psutil.Process(link.pid).wait(10)  # the worker exits after reporting


def test_bad_package_reports_worker_failed(ctx, board, runtime_dir):
    missing = os.path.join(runtime_dir, "no-such-package")
    with make_link(ctx, board, runtime_dir, backend="ref", package_path=missing) as link:
        events = collect(link, lambda ev: any(isinstance(e, (Ready, WorkerFailed)) for e in ev))
        assert [type(e) for e in events if isinstance(e, (Ready, WorkerFailed))] == [WorkerFailed]


def test_sigkill_mid_job_leaves_no_shm_after_stop(ctx, board, runtime_dir):
    rng = np.random.default_rng(3)
    link = make_link(ctx, board, runtime_dir)
    start_ready(link)
    assert len(shm_entries(board)) == 3  # both rings and the doorbell exist while the worker runs
    link.chaos("slow", 30.0)
    job = random_stub_job(rng, 1)
    link.submit(job)
    # Observed, not assumed: the worker reports the job it has started under "slow".
    events = collect(link, lambda ev: any(isinstance(e, Heartbeat) and e.busy_job == job.job_id for e in ev))
    assert not any(isinstance(e, Result) for e in events)
    pid = link.pid
    link.kill()
    psutil.Process(pid).wait(10)
    assert not link.is_alive()
    link.stop()
    link.stop()  # idempotent
    # the `board` fixture asserts /dev/shm holds nothing of this board any more,
    # without any reap_stale: stop() alone cleans up after a killed worker.


def test_worker_exits_when_its_parent_dies(board, runtime_dir):
    script = textwrap.dedent(f"""
        import sys, time, zmq
        import engine.daemon.chip_link
        from engine.daemon.chip_link import ChipLink, Ready
        # A prefix no daemon's start-up reap_stale sweeps: only the worker may unlink these.
        engine.daemon.chip_link.SHM_PREFIX = {ORPHAN_PREFIX!r}
        link = ChipLink(ctx=zmq.Context(), board={board!r}, chip=0, backend="stub",
                        runtime_dir={runtime_dir!r}, heartbeat_interval_s={HB})
        link.start()
        poller = zmq.Poller(); poller.register(link.socket, zmq.POLLIN)
        poller.register(link.result_fd, zmq.POLLIN)
        while not any(isinstance(e, Ready) for e in link.handle_events()):
            poller.poll(100)
        print(link.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        assert len(shm_entries(board)) == 3
        worker = psutil.Process(worker_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 60  # a hang guard only: the worker is waited for, not timed
        while time.monotonic() < deadline:
            try:
                if worker.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            worker.kill()
            pytest.fail("worker did not exit after its parent died")
        # Nobody else will clean up after the dead parent: the orphaned worker
        # itself unlinks both rings and the job doorbell. Checked before any reaping.
        deadline = time.monotonic() + 10
        while shm_entries(board) and time.monotonic() < deadline:
            time.sleep(0.05)
        err = parent.stderr.read()  # the worker inherited the pipe; EOF once it has exited
        assert "Traceback" not in err, err
        assert shm_entries(board) == set(), f"the orphaned worker left its rings or doorbell behind; its log: {err}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        parent.stderr.close()
        reap_stale(ORPHAN_PREFIX)  # only matters when the assertion above failed
        for entry in os.listdir(runtime_dir):  # the dead parent's socket file
            os.unlink(os.path.join(runtime_dir, entry))


def test_chaos_crash_kills_the_worker_and_stop_cleans_up(ctx, board, runtime_dir):
    link = make_link(ctx, board, runtime_dir)
    try:
        start_ready(link)
        pid = link.pid
        link.chaos("crash")
        assert psutil.Process(pid).wait(10) == -signal.SIGKILL
        assert not link.is_alive()
    finally:
        link.stop()


def test_chaos_hang_silences_the_worker_then_it_resumes(ctx, board, runtime_dir):
    rng = np.random.default_rng(4)
    with make_link(ctx, board, runtime_dir) as link:
        collect(link, lambda ev: any(isinstance(e, Ready) for e in ev))
        collect(link, lambda ev: any(isinstance(e, Heartbeat) for e in ev))  # heartbeats flow
        hang_s = 2.0
        sent = time.monotonic()
        link.chaos("hang", hang_s)
        link.submit(random_stub_job(rng, 1))  # after the hang (a job reads the control sent before it)
        # Every event with when it came, until the job's result and a heartbeat after it: however late the
        # worker takes the hang up, the hang is a silence of hang_s somewhere before the result (only a
        # lower bound on time, which no machine's speed breaks), and heartbeats every HB around it.
        stamped: list[tuple[float, object]] = []
        poller = link_poller(link)
        deadline = time.monotonic() + 60  # a hang guard only
        while not (any(isinstance(e, Result) for _, e in stamped)
                   and isinstance(stamped[-1][1], Heartbeat)
                   and any(isinstance(e, Result) for _, e in stamped[:-1])):
            assert time.monotonic() < deadline, f"timed out; events so far: {stamped[-5:]}"
            poller.poll(100)
            now = time.monotonic()
            stamped += [(now, e) for e in link.handle_events()]
        result_at = next(k for k, (_, e) in enumerate(stamped) if isinstance(e, Result))
        before = [sent] + [t for t, _ in stamped[:result_at + 1]]
        gaps = [b - a for a, b in zip(before, before[1:])]
        assert gaps and max(gaps) >= hang_s / 2, f"no silence before the job's result: a hung worker answered " \
                                                  f"(longest gap {max(gaps, default=0):.3f} s)"
        assert link.is_alive()
        assert [e.result.status for _, e in stamped if isinstance(e, Result)] == [JobStatus.OK]


def test_chaos_slow_adds_device_time_to_every_job(ctx, board, runtime_dir):
    rng = np.random.default_rng(5)
    with make_link(ctx, board, runtime_dir) as link:
        collect(link, lambda ev: any(isinstance(e, Ready) for e in ev))
        link.chaos("slow", 0.3)
        slow = run_jobs(link, [random_stub_job(rng, i) for i in range(2)])
        link.chaos("slow", 0.0)
        fast = run_jobs(link, [random_stub_job(rng, 10)])
    assert all(r.device_us >= 300_000 and r.worker_us >= r.device_us for r in slow.values())
    # the 0.3 s is gone again: the same stub work, measured on the same machine, without it
    assert fast[10].device_us + 200_000 < min(r.device_us for r in slow.values())


# -- ref: a real transformer, so the job stream must be a coherent KV story -------

class RefStream:
    """Random but coherent prefill/decode traffic over a paged KV cache.

    Sequences get disjoint blocks; prompts are prefilled in one or two chunks
    (the first chunk samples nothing); decode batches put a random subset of
    live sequences into random lanes of a compiled batch.
    """

    def __init__(self, rng, vocab: int, block_size: int, num_blocks: int):
        self.rng, self.vocab, self.bs = rng, vocab, block_size
        self.free = list(range(num_blocks))
        self.live: dict[int, dict] = {}
        self.next_seq = 0
        self.next_job = 0

    def _blocks_for(self, seq: dict, ctx: int) -> None:
        while len(seq["blocks"]) * self.bs < ctx:
            seq["blocks"].append(self.free.pop())

    def _job(self, kind, lanes: list[dict | None], counts: list[int]) -> Job:
        b = len(lanes)
        toks, pos, ctx, tables, sample = [], [], np.zeros(b, np.int32), np.full((b, 8), -1, np.int32), np.zeros(b, np.uint8)
        params = _sampling(self.rng, b)
        for i, (seq, n) in enumerate(zip(lanes, counts)):
            if seq is None:
                continue
            start = seq["ctx"]
            seq["ctx"] += n
            self._blocks_for(seq, seq["ctx"])
            toks.append(self.rng.integers(0, self.vocab, n))
            pos.append(np.arange(start, start + n))
            ctx[i] = seq["ctx"]
            tables[i, : len(seq["blocks"])] = seq["blocks"]
            sample[i] = seq.pop("sample_now", 1)
            params["seed"][i] = seq["seed"]
        self.next_job += 1
        return Job(
            job_id=self.next_job, generation=1, kind=kind,
            tokens=np.concatenate(toks or [[]]).astype(np.int32), positions=np.concatenate(pos or [[]]).astype(np.int32),
            query_start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            lane_valid=np.array([s is not None for s in lanes], np.uint8), context_lens=ctx,
            block_tables=tables, sample=sample, return_logits=bool(self.rng.random() < 0.3), **params,
        )

    def next(self) -> Job:
        if len(self.live) < 3 or (len(self.live) < 20 and self.rng.random() < 0.25):
            self.next_seq += 1
            seq = {"ctx": 0, "blocks": [], "seed": int(self.rng.integers(0, 2**63)), "prompt": int(self.rng.integers(2, 40))}
            self.live[self.next_seq] = seq
            first = seq["prompt"] if self.rng.random() < 0.5 else int(self.rng.integers(1, seq["prompt"]))
            seq["sample_now"] = int(first == seq["prompt"])
            seq["pending"] = seq["prompt"] - first
            return self._job(JobKind.PREFILL, [seq], [first])
        half_done = [s for s in self.live.values() if s["pending"]]
        if half_done:
            seq = half_done[0]
            n, seq["pending"] = seq["pending"], 0
            return self._job(JobKind.PREFILL, [seq], [n])
        b = int(self.rng.choice([1, 4, 8, 16]))
        k = int(self.rng.integers(1, min(b, len(self.live)) + 1))
        chosen = [self.live[i] for i in self.rng.choice(list(self.live), k, replace=False)]
        lanes: list[dict | None] = chosen + [None] * (b - k)
        self.rng.shuffle(lanes)
        job = self._job(JobKind.DECODE, lanes, [1 if s is not None else 0 for s in lanes])
        for sid, seq in list(self.live.items()):
            if seq["ctx"] >= 100:  # finished: its blocks go back to the pool
                self.free += seq["blocks"]
                del self.live[sid]
        return job


@pytest.fixture(scope="module")
def ref_package():
    from workers.default_package import ensure_default_package

    return ensure_default_package()


@pytest.fixture
def worker_blas_pool():
    """This process's OpenBLAS pool sized as a worker's (`worker_environ`: 1 thread unless the operator says),
    for the time of a test that compares the two bit for bit: on some CPUs (seen on an AVX-512 EPYC) sgemm
    rounds differently with 1 and 2 threads. Afterwards the pool is set back to this process's default
    (its environment's BLAS thread count, else one per core), which is what it started with."""
    from tools.bench.micro.backend import openblas_threads, set_openblas_threads
    from workers.control import worker_environ

    set_openblas_threads(openblas_threads(worker_environ()) or os.cpu_count() or 1)
    yield
    set_openblas_threads(openblas_threads(os.environ) or os.cpu_count() or 1)


def test_few_hundred_ref_jobs_equal_in_process_calls(ctx, board, runtime_dir, ref_package, worker_blas_pool):
    from workers.package_loader import load_package

    oracle = make_backend("ref")
    oracle.load(load_package(ref_package))
    info = oracle.describe()
    stream = RefStream(np.random.default_rng(6), info.vocab_size, info.kv.block_size, info.kv.num_blocks)
    jobs = [stream.next() for _ in range(300)]
    assert {j.batch for j in jobs if j.kind == JobKind.DECODE} == {1, 4, 8, 16}
    assert any(j.kind == JobKind.PREFILL and not j.sample[0] for j in jobs)  # chunked prefills
    with make_link(ctx, board, runtime_dir, backend="ref", package_path=ref_package) as link:
        ready = collect(link, lambda ev: any(isinstance(e, Ready) for e in ev))
        assert [e for e in ready if isinstance(e, Ready)][0].info.model_sha256 == info.model_sha256
        results = run_jobs(link, jobs)
    for job in jobs:  # in submission order: the oracle's KV follows the same story
        assert_matches(results[job.job_id], job, expected_result(oracle, job))
    assert any(results[j.job_id].logits is not None for j in jobs)


def test_logits_too_large_for_the_result_ring_fail_that_job_only(ctx, board, runtime_dir, ref_package):
    stream = RefStream(np.random.default_rng(7), 320, 16, 1024)
    prefill = stream.next()
    prefill.return_logits = False
    # B=16 logits of the tiny model are 16 x 320 x 4 = 20 KiB, more than the whole 16 KiB ring.
    big = stream._job(JobKind.DECODE, [stream.live[1]] * 1 + [None] * 15, [1] + [0] * 15)
    big.return_logits = True
    small = stream._job(JobKind.DECODE, [stream.live[1]] + [None] * 15, [1] + [0] * 15)
    small.return_logits = False
    with make_link(ctx, board, runtime_dir, backend="ref", package_path=ref_package, ring_bytes=16 << 10) as link:
        results = run_jobs(link, [prefill, big, small])
    assert results[prefill.job_id].status == JobStatus.OK
    assert results[big.job_id].status == JobStatus.FAILED and results[big.job_id].logits is None
    assert results[small.job_id].status == JobStatus.OK and results[small.job_id].tokens[0] >= 0


# -- the result doorbell ----------------------------------------------------------

def test_result_doorbell_alone_wakes_a_poller_for_every_result(ctx, board, runtime_dir):
    """The daemon's hot path waits on `result_fd`: each batch of results must wake it, none may be lost."""
    rng = np.random.default_rng(8)
    with make_link(ctx, board, runtime_dir) as link:
        collect(link, lambda ev: any(isinstance(e, Ready) for e in ev))
        assert not os.get_inheritable(link.result_fd)  # no other child of ours inherits it
        assert os.readlink(f"/proc/{link.pid}/fd/{link.result_fd}") == "anon_inode:[eventfd]"
        bell = zmq.Poller()
        bell.register(link.result_fd, zmq.POLLIN)
        assert bell.poll(0) == [], "the doorbell rang with no result"
        next_id = 0
        for in_flight in (1, 1, 2, 3, 5, 8) * 6:
            jobs = [random_stub_job(rng, next_id + i) for i in range(in_flight)]
            next_id += in_flight
            for job in jobs:
                link.submit(job)
            got: set[int] = set()
            while len(got) < in_flight:
                assert bell.poll(5000), f"no wake-up for results {sorted({j.job_id for j in jobs} - got)}"
                got |= {e.result.job_id for e in link.handle_events() if isinstance(e, Result)}
            assert got == {j.job_id for j in jobs}
            # A ring that came before its last bell may leave one wake-up behind; handling it drains the fd.
            link.handle_events()
            assert bell.poll(0) == [], "handle_events left the doorbell readable"


def test_no_fd_outlives_start_stop_restart_or_a_crash(ctx, board, runtime_dir):
    proc = psutil.Process()

    def fds_settle_to(limit: int) -> int:
        deadline = time.monotonic() + 30.0  # ZeroMQ's reaper thread closes socket fds asynchronously
        while proc.num_fds() > limit and time.monotonic() < deadline:
            time.sleep(0.02)
        return proc.num_fds()

    def settled_fds() -> int:
        n, deadline = proc.num_fds(), time.monotonic() + 5.0
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if (m := proc.num_fds()) == n:
                break
            n = m
        return n

    rng = np.random.default_rng(9)
    link = make_link(ctx, board, runtime_dir)
    try:
        start_ready(link)  # warm-up: the context's I/O thread opens its own fds on first use
        link.stop()
        baseline = settled_fds()
        start_ready(link)
        running = proc.num_fds()
        first_fd = link.result_fd
        link.restart()
        assert link.result_fd is not None
        collect(link, lambda ev: any(isinstance(e, Ready) for e in ev))
        assert fds_settle_to(running) == running, "restart kept the old link's fds"
        assert run_jobs(link, [random_stub_job(rng, i) for i in range(20)]).keys() == set(range(20))
        link.kill()
        link.restart()
        collect(link, lambda ev: any(isinstance(e, Ready) for e in ev))
        assert fds_settle_to(running) == running, "restart after a crash kept the old link's fds"
        link.stop()
        assert link.result_fd is None and first_fd is not None
        assert fds_settle_to(baseline) == baseline, "stop left an fd open"
    finally:
        link.stop()
