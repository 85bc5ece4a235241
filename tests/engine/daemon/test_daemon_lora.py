"""LoRA adapters on a live ref board: served side by side, keyed in the KV, loaded and unloaded under load.

One board for the module (ref, one chip, three adapters from `--lora`, two
device slots so the third forces swaps). Expected tokens come from the base
model with each adapter merged into its weights, recomputed without a cache:
nothing of the serving path.
"""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import orjson
import psutil
import pytest

from engine.errors import ClientError
from daemon_procs import daemon_process
from http_front_procs import http_front_process
from waiting import wait_until
from workers.lora.adapter_package import read_adapter, read_adapter_facts
from workers.lora.maker import make_lora
from workers.model_maker import make_model
from workers.package_loader import load_package
from workers.transformer import Transformer

pytestmark = pytest.mark.integration

ALL = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_model(str(root / "base"), max_seq=256, kv_num_blocks=96, seed=3, golden_cases=1, profiles=(1, 4, 8))
    adapters = {f"a{i}": make_lora(base, str(root / f"a{i}"), rank=4 + 2 * i, targets=ALL if i == 1 else ["wq", "wv", "w_up"],
                                   seed=40 + i) for i in range(3)}
    other = make_model(str(root / "other"), layers=3, max_seq=64, kv_num_blocks=8, golden_cases=1)
    adapters["other"] = make_lora(other, str(root / "for-other"), rank=2, seed=1)
    adapters["spare"] = make_lora(base, str(root / "spare"), rank=2, seed=9)
    return root, base, adapters


@pytest.fixture(scope="module")
def board(files):
    root, base, adapters = files
    extra = ["--package", base]
    for name in ("a0", "a1", "a2"):
        extra += ["--lora", f"{name}={adapters[name]}"]
    with daemon_process("ref", 1, settings={"lora.max_loaded_per_chip": 2, "lora.max_cached": 2,
                                            "admission.max_waiting_requests": 256,
                                            "queues.tenants.fin.default_adapter": "a1",
                                            "queues.tenants.ops.allowed_adapters": ["a0"]}, extra=extra) as d:
        yield d


@pytest.fixture(scope="module")
def expect(files):
    """Greedy tokens of the base model (None) or of an adapter merged into it, recomputed from scratch."""
    _, base, adapters = files
    pkg = load_package(base)
    models: dict = {}

    def run(adapter: str | None, prompt: list[int], n: int) -> list[int]:
        if adapter not in models:
            w = pkg.weights()
            if adapter is not None:
                w = read_adapter(read_adapter_facts(adapters[adapter])).merged_into(w)
            models[adapter] = Transformer(pkg.dims, w, vocab_size=pkg.vocab_size, max_seq=pkg.max_seq)
        seq, out = list(prompt), []
        for _ in range(n):
            out.append(int(np.argmax(models[adapter].dense_logits(seq)[-1])))
            seq.append(out[-1])
        return out
    return run


def _prompt(seed: int, n: int) -> list[int]:
    return [256] + np.random.default_rng(seed).integers(0, 256, n - 1).tolist()


def _gen(d, prompt, n, **kw):
    with d.client(timeout=120) as c:
        return c.generate(prompt, max_tokens=n, ignore_eos=True, **kw)


def test_adapters_and_the_base_mixed_each_get_their_merged_models_tokens(board, expect):
    jobs = []
    for i in range(16):
        who = [None, "a0", "a1", "a2"][i % 4]
        kw = {} if who is None else ({"adapter": who} if i % 8 < 4 else {"model": who})
        jobs.append((who, _prompt(100 + i, 5 + i), kw))
    got: dict[int, list[int]] = {}

    def client(idx: list[int]) -> None:
        with board.client(timeout=120) as c:
            for i in idx:
                who, prompt, kw = jobs[i]
                got[i] = c.generate(prompt, max_tokens=6, ignore_eos=True, **kw).tokens

    threads = [threading.Thread(target=client, args=([i for i in range(16) if i % 8 == k],)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (who, prompt, _) in enumerate(jobs):
        assert got[i] == expect(who, prompt, 6), (i, who)
    assert len({tuple(got[i]) for i in range(4)}) == 4  # four different models, not one
    with board.client(timeout=10) as c:  # the worker reports its slots with its heartbeats
        wait_until(lambda: sum(ch["swaps"] for ch in c.stats()["lora"]["chips"]) >= 3, 30, what="the swaps")
        st = c.stats()
    lora = st["lora"]
    [chip] = lora["chips"]
    samples = {(name, tuple(sorted(labels.items()))): v for f in st["metrics"] for name, labels, v in f["samples"]}

    def metric(name: str, **labels) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x
                                                                              for k, x in labels.items()))
    assert metric("npuserve:lora_swaps_total") == chip["swaps"] and metric("npuserve:lora_swap_seconds_total") > 0
    assert metric("npuserve:lora_adapters_loaded") == chip["loaded"]
    assert metric("npuserve:lora_requests_total", adapter="a1") == lora["adapters"]["a1"]["requests"]
    assert metric("npuserve:lora_tokens_total", adapter="a2") == lora["adapters"]["a2"]["tokens"] > 0
    assert chip["slots"] == 2 and chip["loaded"] <= 2 and chip["swaps"] >= 3  # three adapters through two slots
    assert lora["adapters"]["a1"]["requests"] >= 4 and lora["adapters"]["a1"]["tokens"] >= 24


def test_an_unknown_adapter_is_404_adapter_not_found(board):
    with pytest.raises(ClientError) as e:
        _gen(board, [1, 2, 3], 2, adapter="nope")
    assert (e.value.code, e.value.reason) == (404, "adapter_not_found")
    with pytest.raises(ClientError) as e:
        _gen(board, [1, 2, 3], 2, model="nope")
    assert e.value.code == 404


def test_a_tenant_gets_its_default_adapter_and_only_its_allowed_ones(board, expect):
    prompt = _prompt(31, 7)
    assert _gen(board, prompt, 4, tenant="fin").tokens == expect("a1", prompt, 4)  # its default adapter
    assert _gen(board, prompt, 4, tenant="fin", adapter="a2").tokens == expect("a2", prompt, 4)  # named wins
    assert _gen(board, prompt, 4, tenant="ops", adapter="a0").tokens == expect("a0", prompt, 4)
    assert _gen(board, prompt, 4, tenant="ops").tokens == expect(None, prompt, 4)  # no default: the base
    with pytest.raises(ClientError) as e:
        _gen(board, prompt, 4, tenant="ops", model="a1")
    assert (e.value.code, e.value.reason) == (403, "adapter_forbidden")


def test_models_lists_each_adapter_with_its_parent(board):
    with board.client(timeout=10) as c:
        models = c.call("models")["models"]
    base = [m for m in models if m.get("default")][0]["alias"]
    loras = {m["alias"]: m for m in models if m.get("kind") == "lora"}
    assert {"a0", "a1", "a2"} <= set(loras)
    assert all(m["parent"] == base and m["state"] == "ready" for m in loras.values())
    assert loras["a1"]["rank"] == 6 and loras["a1"]["targets"] == ALL


def test_a_prompt_cached_under_one_adapter_misses_under_another(board, expect):
    prompt = _prompt(7, 70)  # four full blocks of 16
    first = _gen(board, prompt, 3, adapter="a0")
    again = _gen(board, prompt, 3, adapter="a0")
    other = _gen(board, prompt, 3, adapter="a2")
    plain = _gen(board, prompt, 3)
    assert again.usage["cached_tokens"] >= 64  # the prefix cache works for the same adapter
    assert other.usage["cached_tokens"] == 0 and plain.usage["cached_tokens"] == 0
    assert first.tokens == again.tokens == expect("a0", prompt, 3)
    assert other.tokens == expect("a2", prompt, 3) and plain.tokens == expect(None, prompt, 3)


def test_a_damaged_or_other_base_adapter_is_refused_at_load_and_the_board_serves_on(board, files, tmp_path):
    _, _, adapters = files
    damaged = str(tmp_path / "damaged")
    shutil.copytree(adapters["spare"], damaged)
    with open(os.path.join(damaged, "adapter.npz"), "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 16)
    with board.client(timeout=60) as c:
        for path, step, words in ((damaged, "verify", "sha256 does not match"),
                                  (adapters["other"], "validate", "made for 3 layers"),
                                  (str(tmp_path / "absent"), "resolve", "not an adapter package")):
            with pytest.raises(ClientError) as e:
                c.call("load_lora", alias="bad", package=path)
            assert e.value.details.get("step") == step and words in e.value.message, e.value.message
        names = {m["alias"] for m in c.call("models")["models"]}
    assert "bad" not in names
    assert _gen(board, [5, 6, 7], 2, adapter="a0").tokens  # serving on


def test_unload_under_load_lets_running_requests_finish_then_404(board, files, expect):
    _, _, adapters = files
    prompt = _prompt(11, 9)
    with board.client(timeout=60) as c:
        c.call("load_lora", alias="tmp", package=adapters["spare"])
        stream = c.stream(prompt, max_tokens=200, ignore_eos=True, adapter="tmp")
        first = next(stream)  # running on the adapter now, 199 decode steps to go
        reply = c.call("unload_lora", alias="tmp")
        assert reply["adapter"]["state"] == "unloading" and reply["adapter"]["active_requests"] == 1
        rest = [t for chunk in stream for t in chunk]
    assert first + rest == expect_spare(expect, files, prompt, 200)
    with pytest.raises(ClientError) as e:
        _gen(board, prompt, 2, adapter="tmp")
    assert e.value.reason == "adapter_not_found"


def expect_spare(expect, files, prompt, n):
    """The spare adapter's greedy tokens, solo on an in-process ref backend (200 dense recomputes are slow;
    the paged path with an adapter equals the merged model: tests/workers/test_lora_ref.py)."""
    from ipc.records import JobKind, Lane, build_job
    from workers.backends.ref import RefBackend

    _, base, adapters = files
    b = RefBackend(lora_slots=1)
    b.load(base)
    b.load_adapter(0, b.read_adapter(adapters["spare"], ""))
    table = list(range(-(-(len(prompt) + n) // 16)))
    job = build_job(JobKind.PREFILL, [Lane(prompt, 0, table)])
    out: list[int] = []
    while len(out) < n:
        job.adapter = np.zeros(1, np.int32)
        step = b.prefill(job) if job.kind == JobKind.PREFILL else b.decode(job)
        out.append(int(np.argmax(step.logits[0])))
        job = build_job(JobKind.DECODE, [Lane([out[-1]], len(prompt) + len(out) - 1, table)])
    return out


def test_100_load_unload_cycles_leak_no_device_slot_nor_host_memory(board, files):
    _, _, adapters = files
    worker = psutil.Process(board.worker_pids()[0])

    def cycle(c, i: int) -> None:
        c.call("load_lora", alias="cyc", package=adapters["spare"])
        c.generate([1, 2, 3, i % 200], max_tokens=1, ignore_eos=True, adapter="cyc")  # swapped onto the chip
        c.call("unload_lora", alias="cyc")

    with board.client(timeout=60) as c:
        for i in range(10):  # warm up the allocator before measuring
            cycle(c, i)
        rss0 = worker.memory_info().rss
        for i in range(100):
            cycle(c, i)
        wait_until(lambda: all(ch["registered"] == 3 for ch in c.stats()["lora"]["chips"]), 30,
                   what="the worker to drop the unloaded adapter")
        [chip] = c.stats()["lora"]["chips"]
    # only the three configured adapters are known, on at most the two slots, and cached at most max_cached
    assert chip["registered"] == 3 and chip["loaded"] <= 2 and chip["cached"] <= 2
    assert worker.memory_info().rss - rss0 < 32 << 20


def test_http_model_names_an_adapter_and_v1_models_lists_its_parent(board, expect):
    with http_front_process(board.endpoint) as front:
        wait_until(lambda: b'"a1"' in front.get("/v1/models")[1], 30, what="the front to learn the adapters")
        data = orjson.loads(front.get("/v1/models")[1])["data"]
        by_id = {m["id"]: m for m in data}
        base = [m["id"] for m in data if "parent" not in m][0]
        assert by_id["a1"]["parent"] == base
        import urllib.request
        prompt = _prompt(21, 8)
        body = orjson.dumps({"model": "a1", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        req = urllib.request.Request(front.url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = orjson.loads(r.read())
        with board.client(timeout=60) as c:
            wire = c.generate(prompt, max_tokens=4, ignore_eos=True, adapter="a1")
            plain = c.generate(prompt, max_tokens=4, ignore_eos=True)
    assert wire.tokens == expect("a1", prompt, 4) and plain.tokens == expect(None, prompt, 4)
    assert out["model"] == "a1"
    assert out["choices"][0]["text"] == wire.text != plain.text


def test_a_host_tier_block_computed_under_one_adapter_is_a_miss_under_another(daemon, files, expect):
    """The worker that computed the prompt dies (its device prefix cache with it); the board's host pool keeps
    the blocks, keyed by adapter: another adapter misses them, the same adapter hits them."""
    _, base, adapters = files
    d = daemon(backend="ref", chips=1, settings={"kv.num_blocks": 24, "kv.host_pool_mb": 1, "kv.promote": "always"},
               extra=["--package", base, "--lora", f"a0={adapters['a0']}", "--lora", f"a2={adapters['a2']}"])
    prompt = _prompt(5, 53)  # three full blocks of 16

    def hits(c) -> int:
        return c.stats()["scheduler"]["kv_tiers"]["counters"].get("hit_host_blocks", 0)

    with d.client(timeout=60) as c:
        cold = c.generate(prompt, max_tokens=4, ignore_eos=True, adapter="a0").tokens
        c.generate(prompt, max_tokens=4, ignore_eos=True)  # the base model's blocks of the prompt, too
        victim = c.health()["chips"][0]["pid"]
        os.kill(victim, 9)
        wait_until(lambda: c.health()["chips"][0]["pid"] not in (None, victim)
                   and c.health()["chips"][0]["state"] == "up", 30, what="the worker restart")
        before = hits(c)
        other = c.generate(prompt, max_tokens=4, ignore_eos=True, adapter="a2")
        after_other = hits(c)
        warm = c.generate(prompt, max_tokens=4, ignore_eos=True, adapter="a0")
        after_same = hits(c)
    assert other.tokens == expect("a2", prompt, 4) and after_other == before
    assert warm.tokens == cold == expect("a0", prompt, 4)
    assert after_same - after_other == 3


def test_a_new_generation_of_the_base_serves_the_adapters_too(board, files, expect):
    """A replace makes a new generation of the base alias, with new workers: they get the adapters."""
    _, base, _ = files
    prompt = _prompt(41, 9)
    with board.client(timeout=300) as c:
        alias = [m for m in c.call("models")["models"] if m.get("default")][0]["alias"]
        reply = c.call("replace", alias=alias, package=base)
        assert reply["model"]["generation"] != reply["previous"]["generation"]
        got = c.generate(prompt, max_tokens=4, ignore_eos=True, adapter="a2")
    assert got.generation == reply["model"]["generation"]
    assert got.tokens == expect("a2", prompt, 4)


def test_a_replace_with_a_base_the_loaded_adapters_do_not_fit_is_refused_and_the_board_serves_on(board, files,
                                                                                                  expect):
    """The new package is checked against every adapter loaded on the alias, as the adapter gate checks one."""
    root, _, _ = files
    other = str(root / "other")  # three layers: no adapter of the base fits it
    prompt = _prompt(43, 6)
    with board.client(timeout=300) as c:
        alias = [m for m in c.call("models")["models"] if m.get("default")][0]["alias"]
        before = c.generate(prompt, max_tokens=3, ignore_eos=True, adapter="a1").generation
        with pytest.raises(ClientError) as e:
            c.call("replace", alias=alias, package=other)
        loras = {m["alias"] for m in c.call("models")["models"] if m.get("kind") == "lora" and m["state"] == "ready"}
        got = c.generate(prompt, max_tokens=3, ignore_eos=True, adapter="a1")
    assert (e.value.code, e.value.reason) == (400, "package_rejected")
    assert "validate" in str(e.value) and all(n in str(e.value) for n in ("a0", "a1", "a2")), str(e.value)
    assert {"a0", "a1", "a2"} <= loras  # nothing unloaded
    assert got.generation == before and got.tokens == expect("a1", prompt, 3)  # still the base it fits
