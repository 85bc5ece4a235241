"""The layering rules of DESIGN §3, checked on the source itself.

`ipc` is transport only and must not import `engine` or `workers`;
`workers` must not import `engine`; the sans-I/O core must not touch
sockets, shared memory, signals or clocks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


RULES = [
    ("ipc", ("engine", "workers", "tools")),
    ("workers", ("engine", "tools")),
    ("engine/core", ("zmq", "posix_ipc", "signal", "time", "threading", "asyncio", "socket", "mmap", "datetime")),
]


@pytest.mark.parametrize("package,forbidden", RULES, ids=[r[0] for r in RULES])
def test_layering(package: str, forbidden: tuple[str, ...]) -> None:
    files = _modules(package)
    assert files, f"no modules under {package}"
    offenders = []
    for path in files:
        for name in _imports(path):
            if name.split(".")[0] in forbidden:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_rule_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import zmq\nfrom engine.core import scheduler\n")
    assert {"zmq", "engine.core"} <= _imports(bad)
