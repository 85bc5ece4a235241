"""`npuserve bench serve lora --backend sim`: the sim row runs end to end (a sim board with adapters) and says so.

No figure is checked (this machine is loaded); only that both routes were served on a sim board."""

from __future__ import annotations

import orjson
import pytest

from tools.load import lora_mix

pytestmark = pytest.mark.integration


def test_the_sim_row_serves_the_base_and_the_adapter_mix_on_a_sim_board(capsys):
    assert lora_mix.main(["--backend", "sim", "--adapters", "3", "--requests", "6", "--streams", "3",
                          "--max-tokens", "4", "--rounds", "1", "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["backend"] == "sim" and out["adapters"] == 3
    [row] = out["rounds"]
    assert row["base"] > 0 and row["mix"] > 0
