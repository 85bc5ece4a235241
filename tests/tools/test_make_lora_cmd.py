"""`npuserve make-lora`: writes an adapter the base accepts; bad arguments get a message and exit 1."""

from __future__ import annotations

from tools.make_lora_cmd import main
from workers.lora.adapter_package import read_adapter_facts
from workers.model_maker import make_model


def test_make_lora_writes_an_adapter_for_the_base(tmp_path, capsys):
    base = make_model(str(tmp_path / "base"), max_seq=64, kv_num_blocks=8, golden_cases=1)
    out = tmp_path / "lora"
    assert main(["--base", base, "--rank", "4", "--targets", "wq", "w_down", "--seed", "3", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    facts = read_adapter_facts(str(out))
    assert (facts.rank, facts.targets, facts.alpha) == (4, ("wq", "w_down"), 8.0)
    assert main(["--base", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 1
    assert "not a model package directory" in capsys.readouterr().err
    assert main(["--base", base, "--rank", "0", "--out", str(tmp_path / "y")]) == 1
    assert "rank" in capsys.readouterr().err
