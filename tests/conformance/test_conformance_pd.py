"""The conformance suite against a prefill/decode pair behind a balancer: a `ref` board with
`board.role = "prefill"` and one with `"decode"`, the balancer's [[backends]] naming the roles."""

from __future__ import annotations

import pytest
from conformance_procs import Procs, assert_conforms, run_conformance

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pd_pair():
    with Procs() as procs:
        _, ep = procs.daemon(backend="ref", tcp=True, settings={"board.role": "prefill"})
        _, ed = procs.daemon(backend="ref", tcp=True, settings={"board.role": "decode"})
        yield procs, procs.balancer([{"endpoint": ep, "role": "prefill"}, {"endpoint": ed, "role": "decode"}],
                             policy="prefix")


def test_a_prefill_decode_pair_behind_the_balancer_conforms(pd_pair, capsys):
    procs, bal = pd_pair
    code, rows, summary = run_conformance(capsys, bal.endpoint, "--admin-denied")
    assert summary["endpoint_kind"] == "balancer"
    assert_conforms(code, rows, {"second_model", "error_429_overloaded", "drain_resume", "model_lifecycle"}, procs)
    with bal.client() as c:
        assert c.stats()["balancer"]["counters"]["pd_handoffs"] > 0  # the requests really went in two legs
