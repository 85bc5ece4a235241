"""executor.decode_steps = 4 on the `ctypes` backend with the reference chip library: the worker hands each
multi-step decode job to the library's device loop (simpler_model_decode_steps_paged, sampling on the
device), and every stream equals the one-step run's (decode_steps = 1: a host round trip and host sampling
per token) -- tokens, finish reasons and logprobs -- across EOS, stop ids and max_tokens cuts."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from engine.async_client import AsyncClient
from workers.backends.ctypes_backend import build_reference_library

pytestmark = pytest.mark.integration


def _workload(n: int) -> list[dict]:
    rng = random.Random(23)
    reqs = []
    for i in range(n):
        r = dict(prompt=[rng.randrange(2, 320) for _ in range(rng.randrange(1, 40))], max_tokens=rng.randrange(1, 30),
                 seed=rng.randrange(1 << 32), temperature=rng.choice([0.0, 0.7, 1.0, 1.6]),
                 top_k=rng.choice([0, 0, 5, 40]), top_p=rng.choice([1.0, 0.9, 0.5]), logprobs=i % 2 == 0)
        if i % 5 == 0:
            r["stop_token_ids"] = [rng.randrange(2, 320) for _ in range(20)]  # likely hit somewhere mid-job
        reqs.append(r)
    return reqs


def _run(d, reqs: list[dict]) -> list[tuple]:
    async def run():
        async with AsyncClient(d.endpoint, timeout=120) as c:
            return await asyncio.gather(*(c.generate(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"})
                                          for r in reqs))
    return [(r.tokens, r.finish_reason, r.logprobs) for r in asyncio.run(run())]


def test_multi_step_decode_on_the_device_equals_one_step_decode(daemon, tmp_path):
    library = str(build_reference_library(tmp_path))
    trace = tmp_path / "loop.trace"
    settings = {"model.ctypes_library": library, "admission.max_waiting_requests": 512}
    reqs = _workload(48)
    one = daemon(backend="ctypes", settings={**settings, "executor.decode_steps": 1},
                 env={"REF_LOOP_TRACE": str(trace)})
    want = _run(one, reqs)
    one.stop()
    assert not trace.exists()  # one-step jobs never reach the loop
    four = daemon(backend="ctypes", settings={**settings, "executor.decode_steps": 4},
                  env={"REF_LOOP_TRACE": str(trace)})
    got = _run(four, reqs)
    counters = four.client(timeout=10).stats()["scheduler"]["counters"]
    assert counters["multi_step_jobs"] > 5 and counters.get("failed_jobs", 0) == 0, counters
    loops = trace.read_text().splitlines()
    assert len(loops) == counters["multi_step_jobs"]  # every multi-step job ran on the device
    assert {int(line.split()[2]) for line in loops} <= {2, 3, 4}
    mismatches = [(i, g[:2], w[:2]) for i, (g, w) in enumerate(zip(got, want)) if g[:2] != w[:2]]
    assert not mismatches, mismatches[:3]
    assert {w[1] for w in want} >= {"length", "stop"}
    for (_, _, lp_got), (_, _, lp_want), r in zip(got, want, reqs):
        assert (lp_got is None) == (lp_want is None) == (not r["logprobs"])
        if lp_want is not None:
            np.testing.assert_allclose(lp_got, lp_want, rtol=1e-6, atol=1e-6)
