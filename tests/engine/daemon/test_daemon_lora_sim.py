"""LoRA adapters on a live sim board: the scheduler's adapter paths (slots, swaps, metrics) without weights.

One board (sim, one chip, an .npz base package, three adapters of it from
`--lora`, two device slots so the third forces swaps). The sim's tokens do not
depend on the adapter (they are the stub's); what is checked is that requests
on adapters and the base are served side by side and that adapters pass
through the chip's slots.
"""

from __future__ import annotations

import threading

import pytest

from daemon_procs import daemon_process
from waiting import wait_until
from workers.lora.maker import make_lora
from workers.model_maker import make_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-sim")
    base = make_model(str(root / "base"), max_seq=256, kv_num_blocks=96, seed=3, golden_cases=0,
                      profiles=(1, 4, 8))  # no golden cases: the sim's tokens are not the model's
    extra = ["--package", base]
    for i in range(3):
        extra += ["--lora", f"a{i}={make_lora(base, str(root / f'a{i}'), rank=4, seed=40 + i)}"]
    with daemon_process("sim", 1, settings={"lora.max_loaded_per_chip": 2},
                        backend_options={"decode_base_ms": 1.0, "decode_per_lane_ms": 0.0}, extra=extra) as d:
        yield d


def test_a_sim_board_serves_adapters_and_the_base_and_swaps_through_its_slots(board):
    who = [None, "a0", "a1", "a2"] * 3
    got: dict[int, list[int]] = {}

    def client(idx: list[int]) -> None:
        with board.client(timeout=120) as c:
            for i in idx:
                kw = {} if who[i] is None else ({"adapter": who[i]} if i % 2 else {"model": who[i]})
                got[i] = c.generate([1, 2, 3, i], max_tokens=4, ignore_eos=True, **kw).tokens

    threads = [threading.Thread(target=client, args=([i for i in range(len(who)) if i % 4 == k],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(got) == list(range(len(who))) and all(len(t) == 4 for t in got.values())
    with board.client(timeout=10) as c:  # the worker reports its slots with its heartbeats
        wait_until(lambda: sum(ch["swaps"] for ch in c.stats()["lora"]["chips"]) >= 3, 30, what="the swaps")
        st = c.stats()
    lora = st["lora"]
    [chip] = lora["chips"]
    assert chip["slots"] == 2 and chip["loaded"] <= 2 and chip["swaps"] >= 3  # three adapters through two slots
    assert all(lora["adapters"][f"a{i}"]["requests"] == 3 for i in range(3))
    swaps = [v for f in st["metrics"] for name, _, v in f["samples"] if name == "npuserve:lora_swaps_total"]
    assert sum(swaps) == chip["swaps"]
