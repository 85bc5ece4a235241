"""The board's host KV tier on the `llamacpp` backend (Gemma 3 270M), greedy outputs equal to the cold run's:

* two chips: a prefix computed by one chip's worker is a host hit on another worker of the board;
* one chip with a small device pool: the tail of a prefix the device evicted is promoted from the host pool
  after the head the device kept (an imported run that joins a device prefix).
"""

from __future__ import annotations

import os
import signal

from waiting import wait_until

TEXT = ("The history of the Roman Empire begins with the founding of Rome, which according to legend happened "
        "in 753 BC when the twins Romulus and Remus")
LONG = TEXT + ", raised by a she-wolf, quarrelled over where the city should stand"  # 3 whole blocks and a bit
OTHERS = ["Photosynthesis is the process by which green plants and some other organisms use sunlight to make food "
          "from carbon dioxide and water, releasing oxygen as a by-product of the reaction in their leaves",
          "The Pacific Ocean is the largest and deepest of the Earth's five oceanic divisions, stretching from the "
          "Arctic in the north to the Southern Ocean in the south, and covering a third of the surface"]


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


def test_an_evicted_tail_is_promoted_after_the_head_the_device_kept(daemon, gemma_package):
    from workers.llamacpp.tokenizer import GgufTokenizer

    tok = GgufTokenizer(f"{gemma_package}/model.gguf")
    prompt, others = tok.encode(LONG), [tok.encode(t) for t in OTHERS]
    tok.close()
    assert len(prompt) // 16 == 3
    # 6 device blocks: the other two requests evict the prompt's two last cached blocks, not its first
    d = daemon(backend="llamacpp", chips=1, extra=["--package", gemma_package],
               settings={"board.threads_per_chip": 1, "kv.host_pool_mb": 8, "kv.promote": "always",
                         "kv.num_blocks": 6})
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    with d.client(timeout=300) as c:
        cold = c.generate(prompt, **kw).tokens
        for o in others:
            c.generate(o, **kw)
        warm = c.generate(prompt, **kw).tokens
        t = c.stats()["scheduler"]["kv_tiers"]["counters"]
    assert warm == cold
    assert t.get("hit_host_blocks", 0) == 2 and t.get("promoted_blocks", 0) == 2, t  # block 0 was a device hit
    assert t.get("import_failed", 0) == 0, t
