"""Model lifecycle on a real daemon (docs/models.md#model-lifecycle): load/unload/replace/rollback/models over the wire.

Real daemon and worker processes (ref backend, the NumPy transformer), real
packages built by workers/model_maker.py under a model root.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from daemon_procs import shm_objects_of
from waiting import wait_until
from engine.errors import ClientError
from workers.model_maker import make_model
from workers.package_loader import load_package

SMALL = dict(max_seq=256, kv_num_blocks=64, golden_cases=2, golden_max_tokens=6)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A model root with packages a (seed 3) and b (seed 7), and one outside it."""
    base = tmp_path_factory.mktemp("models")
    r = base / "root"
    r.mkdir()
    make_model(str(r / "a"), seed=3, **SMALL)
    make_model(str(r / "b"), seed=7, **SMALL)
    make_model(str(base / "outside"), seed=5, **SMALL)
    return r


def serve(daemon, root, *models: str, settings: dict | None = None, **kw):
    extra = ["--model-root", str(root)]
    for m in models:
        extra += ["--model", m]
    return daemon(backend="ref", chips=1, extra=extra, settings=settings, **kw)


def golden(root, name: str) -> list[dict]:
    return load_package(str(root / name)).golden()


def run_case(c, case: dict, model: str | None = None):
    return c.generate(case["prompt"], max_tokens=case["max_tokens"], ignore_eos=True, model=model, timeout=60)


def test_two_models_on_one_board_each_answers_its_own_and_unloading_one_leaves_the_other(daemon, root):
    d = serve(daemon, root, "a=a")
    ga, gb = golden(root, "a"), golden(root, "b")
    with d.client(timeout=60) as c:
        r = c.call("load", alias="b", package="b")
        entry = r["model"]
        assert entry["alias"] == "b" and entry["state"] == "ready" and entry["default"] is False
        assert entry["sha256"] == load_package(str(root / "b")).sha256
        assert entry["counters"]["golden_passed"] == len(gb)
        models = {m["alias"]: m for m in c.call("models")["models"]}
        assert set(models) == {"a", "b"} and models["a"]["default"] is True
        assert models["a"]["generation"] != models["b"]["generation"]
        for case in ga:  # the default model (no `model` field) is a; b answers b's golden cases
            ra = run_case(c, case)
            assert ra.tokens == case["tokens"] and ra.generation == models["a"]["generation"]
        for case in gb:
            rb = run_case(c, case, model="b")
            assert rb.tokens == case["tokens"] and rb.generation == models["b"]["generation"]
        # a long stream on a, then b is unloaded: a's request goes on untouched
        stream_result: list = []
        chunks = c.stream(ga[0]["prompt"], max_tokens=120, ignore_eos=True, result=stream_result, timeout=60)
        first = next(chunks)
        un = c.call("unload", alias="b")
        assert un["model"]["state"] == "unloaded"
        rest = [t for chunk in chunks for t in chunk]
        assert len(first) + len(rest) == 120 and stream_result[0].finish_reason == "length"
        assert stream_result[0].tokens[:len(ga[0]["tokens"])] == ga[0]["tokens"]
        with pytest.raises(ClientError) as e:
            run_case(c, gb[0], model="b")
        assert e.value.code == 404
        assert [m["alias"] for m in c.call("models")["models"]] == ["a"]
        assert run_case(c, ga[1]).tokens == ga[1]["tokens"]


def _copy(root, src: str, dst: str) -> str:
    shutil.rmtree(root / dst, ignore_errors=True)
    shutil.copytree(root / src, root / dst)
    return str(root / dst)


def test_each_bad_package_is_refused_naming_its_cause_while_the_serving_model_keeps_serving(daemon, root):
    tampered = _copy(root, "b", "tampered")
    with open(os.path.join(tampered, "weights.npz"), "r+b") as fh:
        fh.seek(200)
        byte = fh.read(1)
        fh.seek(200)
        fh.write(bytes([byte[0] ^ 0xFF]))
    missing = _copy(root, "b", "missing")
    os.unlink(os.path.join(missing, "golden.json"))
    narrow = root / "narrow"
    if not narrow.exists():
        make_model(str(narrow), seed=8, profiles=(1,), **SMALL)
    link = root / "link"
    if not link.is_symlink():
        os.symlink(root.parent / "outside", link)
    # the board asks for profiles [1, 4]: a package declaring only [1] does not fit it
    d = serve(daemon, root, "a=a", settings={"batch.profiles": [1, 4]})
    ga = golden(root, "a")
    cases = [("tampered", "verify", "weights.npz: sha256 does not match"),
             ("missing", "verify", "golden.json: missing"),
             ("narrow", "validate", "[4] not among them"),
             ("../outside", "resolve", "'..' is not allowed"),
             (str(root.parent / "outside"), "resolve", "outside the model root"),
             ("link", "resolve", "through a symlink, outside the model root"),
             ("no-such", "resolve", "no such package folder")]
    with d.client(timeout=60) as c:
        inflight: list = []
        chunks = c.stream(ga[0]["prompt"], max_tokens=150, ignore_eos=True, result=inflight, timeout=60)
        next(chunks)
        for package, step, cause in cases:
            with pytest.raises(ClientError) as e:
                c.call("load", alias="x", package=package)
            assert e.value.code == 400 and e.value.reason == "package_rejected", (package, e.value)
            assert f"{step}: " in str(e.value) and cause in str(e.value), (package, str(e.value))
            assert run_case(c, ga[1]).tokens == ga[1]["tokens"]  # the serving model answers, unchanged
        list(chunks)
        assert inflight[0].finish_reason == "length" and len(inflight[0].tokens) == 150
        models = c.call("models")["models"]
        assert [(m["alias"], m["state"]) for m in models] == [("a", "ready"), ("x", "failed")]
        assert models[1]["step"] == "resolve" and "no such package folder" in models[1]["error"]  # the last one
    assert len(shm_objects_of(d.pid)) == 3  # one generation: its job ring, result ring, doorbell


def test_replace_under_steady_load_then_rollback(daemon, root):
    d = serve(daemon, root, "m=a")
    ga, gb = golden(root, "a"), golden(root, "b")
    prompts = {"a": ga[0], "b": gb[0]}
    results: list[tuple[str, int | None, list[int] | None, int | None]] = []  # (prompt, generation, tokens, err)
    stop = threading.Event()

    def load() -> None:
        with d.client(timeout=60) as lc:
            i = 0
            while not stop.is_set():
                name = "ab"[i % 2]
                i += 1
                try:
                    r = run_case(lc, prompts[name], model="m")
                    results.append((name, r.generation, r.tokens, None))
                except ClientError as e:
                    results.append((name, None, None, e.code if e.retryable else -e.code))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        with d.client(timeout=60) as c:
            wait_until(lambda: len(results) >= 4, 30, what="load before the replace")
            g1 = c.call("models")["models"][0]["generation"]
            r = c.call("replace", alias="m", package="b", deadline_s=10)
            g2 = r["model"]["generation"]
            assert r["previous"]["generation"] == g1 and r["model"]["state"] == "ready"
            n = len(results)
            wait_until(lambda: len(results) >= n + 4, 30, what="load after the replace")
            r = c.call("rollback", alias="m", deadline_s=10)
            g3 = r["model"]["generation"]
            assert r["previous"]["generation"] == g2 and r["model"]["package"] == "a"
            n = len(results)
            wait_until(lambda: len(results) >= n + 4, 30, what="load after the rollback")
            wait_until(lambda: [m["generation"] for m in c.call("models")["models"]] == [g3], 30,
                       what="the replaced generations unloaded")
    finally:
        stop.set()
        t.join(60)
    errors = [e for *_, e in results if e is not None]
    assert all(e == 503 for e in errors), errors  # only a retryable 503 may fail a request
    by_gen: dict[int, dict[str, list[int]]] = {}
    for name, gen, tokens, err in results:
        if err is None:
            assert gen in (g1, g2, g3), gen
            seen = by_gen.setdefault(gen, {}).setdefault(name, tokens)
            assert tokens == seen, (gen, name)  # one generation, one answer: never a mix
    assert {g1, g2, g3} <= set(by_gen)
    assert by_gen[g1]["a"] == ga[0]["tokens"] and by_gen[g3]["a"] == ga[0]["tokens"]  # rollback restores a
    assert by_gen[g2]["b"] == gb[0]["tokens"]  # the new generation answers its golden case
    assert by_gen[g3] == by_gen[g1]  # rollback restores the previous outputs


def test_unload_past_its_deadline_with_a_job_in_flight_is_recovering_and_frees_nothing_until_the_job_ends(daemon):
    # sim backend: each decode step takes 1.2 s of "device" time, so a job is in flight at the deadline
    d = daemon(backend="sim", chips=1, backend_options={"decode_base_ms": 1200, "decode_per_lane_ms": 0},
               settings={"recovery.heartbeat_timeout_ms": 10000})  # a sleeping sim worker sends no heartbeat
    with d.client(timeout=60) as c:
        shm_before = shm_objects_of(d.pid)
        worker = d.worker_pids()[0]
        result: list = []
        chunks = c.stream([1, 2, 3], max_tokens=30, ignore_eos=True, result=result, timeout=60)
        next(chunks)
        un = c.call("unload", alias="tiny", deadline_s=0.3)
        assert un["model"]["state"] == "recovering", un
        assert shm_objects_of(d.pid) == shm_before  # its rings are still there: a job may write them
        assert psutil_alive(worker)
        rest = list(chunks)
        assert result[0].finish_reason == "cancelled" and len(rest) < 30  # cut at the deadline, one terminal event
        wait_until(lambda: c.call("models")["models"] == [], 30, what="the recovering generation to unload")
        assert shm_objects_of(d.pid) == [] and not psutil_alive(worker)
        with pytest.raises(ClientError) as e:
            c.generate([1, 2], max_tokens=2)
        assert e.value.code == 503  # no default model any more


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False




CYCLES = 100
RSS_TOLERANCE_MB = 16  # allocator noise over 100 cycles; a leaked generation (scheduler, KV tables) is more


def test_100_load_unload_cycles_return_rss_fds_threads_and_shm_to_baseline(daemon, root):
    import psutil

    d = serve(daemon, root, "a=a")
    proc = psutil.Process(d.pid)
    gb = golden(root, "b")

    def cycle(c) -> None:
        r = c.call("load", alias="b", package="b")
        assert r["model"]["state"] == "ready" and r["model"]["counters"]["golden_passed"] == len(gb), r
        assert c.call("unload", alias="b")["model"]["state"] == "unloaded"

    def usage() -> tuple[int, int, int, list[str]]:
        return proc.memory_info().rss, proc.num_fds(), proc.num_threads(), shm_objects_of(d.pid)

    with d.client(timeout=60) as c:
        for _ in range(3):  # the loader thread and first-use allocations belong to the baseline
            cycle(c)
        rss0, fds0, threads0, shm0 = usage()
        for _ in range(CYCLES):
            cycle(c)
        rss1, fds1, threads1, shm1 = usage()
        assert (fds1, threads1, shm1) == (fds0, threads0, shm0)
        assert rss1 - rss0 < RSS_TOLERANCE_MB << 20, f"RSS grew {(rss1 - rss0) / 2**20:.1f} MiB over {CYCLES} cycles"
        assert len(proc.children()) == 1  # the serving model's one worker
        assert run_case(c, golden(root, "a")[0]).tokens == golden(root, "a")[0]["tokens"]


def test_a_load_beyond_the_boards_memory_budget_is_refused_and_a_replace_drains_the_old_one_first(daemon, root):
    d = serve(daemon, root, "a=a", settings={"board.memory_budget_mb": 2})  # each small package holds ~1.01 MiB
    ga, gb = golden(root, "a"), golden(root, "b")
    with d.client(timeout=60) as c:
        with pytest.raises(ClientError) as e:
            c.call("load", alias="b", package="b")
        msg = str(e.value)
        assert e.value.code == 429 and e.value.reason == "insufficient_capacity", msg
        assert "capacity: " in msg and "the board's budget is 2.0 MiB (board.memory_budget_mb)" in msg, msg
        assert "1.0 MiB is held (a gen 1 1.0 MiB)" in msg and "KV blocks" in msg, msg
        assert run_case(c, ga[0]).tokens == ga[0]["tokens"]  # still serving
        # a replace cannot run both generations: the old one drains first, its stream finishes
        inflight: list = []
        chunks = c.stream(ga[0]["prompt"], max_tokens=100, ignore_eos=True, model="a", result=inflight, timeout=60)
        next(chunks)
        r = c.call("replace", alias="a", package="b", deadline_s=30)
        assert r["model"]["state"] == "ready" and r["previous"]["state"] == "unloaded", r
        list(chunks)
        assert inflight[0].finish_reason == "length" and inflight[0].generation == r["previous"]["generation"]
        after = run_case(c, gb[0], model="a")
        assert after.tokens == gb[0]["tokens"] and after.generation == r["model"]["generation"]
        listed = [(m["alias"], m["generation"], m["state"]) for m in c.call("models")["models"]]
        assert listed == [("b", 2, "failed"), ("a", r["model"]["generation"], "ready")]  # the refused load of b


def test_llamacpp_loads_a_gguf_package_beside_the_serving_one_and_each_answers_its_golden_cases(daemon, tmp_path):
    from workers.default_package import ensure_default_gguf_package

    root = tmp_path / "gguf-root"
    root.mkdir()
    shutil.copytree(ensure_default_gguf_package(), root / "g")
    d = daemon(backend="llamacpp", chips=1, extra=["--model-root", str(root), "--model", "one=g"],
               settings={"board.threads_per_chip": 1})
    cases = load_package(str(root / "g")).golden()
    with d.client(timeout=120) as c:
        r = c.call("load", alias="two", package="g")
        assert r["model"]["state"] == "ready" and r["model"]["counters"]["golden_passed"] == len(cases)
        gens = {m["alias"]: m["generation"] for m in c.call("models")["models"]}
        for alias in ("one", "two"):
            got = run_case(c, cases[0], model=alias)
            assert got.tokens == cases[0]["tokens"] and got.generation == gens[alias]
        assert c.call("unload", alias="one")["model"]["state"] == "unloaded"
        assert run_case(c, cases[-1], model="two").tokens == cases[-1]["tokens"]
