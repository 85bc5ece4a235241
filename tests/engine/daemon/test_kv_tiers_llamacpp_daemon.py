"""The board's host KV tier on the `llamacpp` backend: a prefix computed by one chip's worker is a host hit on
another worker of the board, with the same greedy output (Gemma 3 270M, two chips)."""

from __future__ import annotations

import os
import signal

from tests.conftest import wait_until

TEXT = ("The history of the Roman Empire begins with the founding of Rome, which according to legend happened "
        "in 753 BC when the twins Romulus and Remus")


def test_a_prefix_computed_on_one_chip_is_a_host_hit_on_another(daemon, gemma_package):
    from workers.llamacpp.tokenizer import GgufTokenizer

    tok = GgufTokenizer(f"{gemma_package}/model.gguf")
    prompt = tok.encode(TEXT)
    tok.close()
    whole = len(prompt) // 16
    d = daemon(backend="llamacpp", chips=2, extra=["--package", gemma_package],
               settings={"board.threads_per_chip": 1, "kv.host_pool_mb": 8, "kv.promote": "always",
                         "recovery.max_resets_per_10min": 5})
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    with d.client(timeout=300) as c:
        before = [ch["device_s"] for ch in c.health()["chips"]]
        cold = c.generate(prompt, **kw).tokens
        after = [ch["device_s"] for ch in c.health()["chips"]]
        first = max(range(2), key=lambda i: after[i] - before[i])  # the chip that computed the prefix
        other = 1 - first
        wait_until(lambda: c.stats()["scheduler"]["kv_tiers"]["host"]["blocks"] >= whole, 30,
                   what="the write-through export")
        victim = c.health()["chips"][first]["pid"]
        os.kill(victim, signal.SIGKILL)  # its device KV is gone; the board's host pool is not
        wait_until(lambda: c.health()["chips"][first]["state"] != "up"
                   or c.health()["chips"][first]["pid"] != victim, 30, what="the worker's death noticed")
        mid = [ch["device_s"] for ch in c.health()["chips"]]
        warm = c.generate(prompt, **kw).tokens
        t = c.stats()["scheduler"]["kv_tiers"]
        end = [ch["device_s"] for ch in c.health()["chips"]]
    assert warm == cold
    assert t["counters"].get("hit_host_blocks", 0) >= whole, t
    assert t["counters"].get("import_failed", 0) == 0, t
    assert end[other] > mid[other]  # the other chip served the host hit
