"""The balancer's core modules are sans-I/O like the scheduler's (the rule of tests/test_import_rules.py)."""

from __future__ import annotations

import pytest
from test_import_rules import ROOT, _imports

CORE_MODULES = ("core", "routing", "backend_state", "prefix_index", "stats_merge", "actions")
FORBIDDEN = ("zmq", "posix_ipc", "signal", "time", "threading", "asyncio", "socket", "mmap", "datetime")


@pytest.mark.parametrize("name", CORE_MODULES)
def test_balancer_core_module_touches_no_io(name):
    imported = _imports(ROOT / "engine" / "balancer" / f"{name}.py")
    bad = sorted(n for n in imported if n.split(".")[0] in FORBIDDEN or n.startswith("engine.balancer.shell"))
    assert not bad, f"engine/balancer/{name}.py imports {bad}"
