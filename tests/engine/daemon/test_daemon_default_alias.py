"""`npuserve serve --package DIR` without model.alias answers as the package's own name (made a valid alias),
not as `tiny`."""

from __future__ import annotations

import pytest

from engine.errors import ModelNotFound

pytestmark = pytest.mark.integration

SMALL = dict(layers=1, d_model=16, heads=2, kv_heads=1, max_seq=256, kv_num_blocks=64, golden_cases=1,
             golden_max_tokens=2)


def test_a_package_served_without_model_alias_answers_as_its_manifest_name(daemon, tmp_path):
    from workers.model_maker import make_model

    pkg = make_model(str(tmp_path / "pkg"), name="My Model v2!", **SMALL)
    d = daemon(backend="ref", chips=1, extra=["--package", pkg])
    with d.client(timeout=60) as c:
        assert c.health()["model"]["alias"] == "My-Model-v2"
        (entry,) = c.call("models")["models"]
        assert (entry["alias"], entry["default"]) == ("My-Model-v2", True)
        assert c.generate([1, 2], max_tokens=2, model="My-Model-v2").finish_reason in ("length", "eos")
        assert c.generate([1, 2], max_tokens=2).finish_reason in ("length", "eos")  # the default alias
        with pytest.raises(ModelNotFound):
            c.generate([1, 2], max_tokens=2, model="tiny")
