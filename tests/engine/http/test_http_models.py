"""The HTTP front in front of a board that serves several models (loads, replaces and unloads behind it).

Real daemon (ref backend, two packages under a model root) and a real `npuserve http`; the official
`openai` client. The front learns what the board serves on every heartbeat, so a model loaded or
unloaded on the board appears in, or leaves, `/v1/models` without restarting the front.
"""

from __future__ import annotations

import openai
import orjson
import pytest

from waiting import wait_until
from workers.model_maker import make_model
from workers.package_loader import load_package

SMALL = dict(max_seq=256, kv_num_blocks=64, golden_cases=1, golden_max_tokens=6)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("httpmodels")
    for name, seed in (("a", 3), ("b", 7), ("c", 11)):
        make_model(str(r / name), seed=seed, **SMALL)
    return r


def listed(front) -> list[str]:
    status, body = front.get("/v1/models")
    assert status == 200, body
    return sorted(m["id"] for m in orjson.loads(body)["data"])


@pytest.mark.integration
def test_each_model_answers_its_own_golden_case_and_loads_and_unloads_show_up(daemon, http_front, root):
    d = daemon(backend="ref", chips=1, extra=["--model-root", str(root), "--model", "a=a", "--model", "b=b"])
    front = http_front(d.endpoint)
    oa = openai.OpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert listed(front) == ["a", "b"]
    for name in ("a", "b"):
        case = load_package(str(root / name)).golden()[0]
        r = oa.completions.create(model=name, prompt=case["prompt"], max_tokens=case["max_tokens"],
                                  temperature=0, extra_body={"ignore_eos": True})
        assert r.model == name and r.usage.completion_tokens == case["max_tokens"]
    # the same prompt on the two models: each answers with its own weights
    case_a = load_package(str(root / "a")).golden()[0]
    outs = {name: oa.completions.create(model=name, prompt=case_a["prompt"], max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text for name in ("a", "b")}
    assert outs["a"] != outs["b"], outs

    with d.client(timeout=60) as c:
        c.call("load", alias="c", package="c")
        wait_until(lambda: listed(front) == ["a", "b", "c"], 30, what="the front to learn the loaded model")
        c.call("unload", alias="b")
        wait_until(lambda: listed(front) == ["a", "c"], 30, what="the front to forget the unloaded model")
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="b", prompt="x", max_tokens=1)
    assert "does not exist here" in str(e.value)
