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


def _package_of(path: Path) -> list[str]:
    """The dotted package a module under ROOT belongs to, as parts."""
    rel = path.resolve().relative_to(ROOT)
    return list(rel.parent.parts)


def _imports(path: Path, source: str | None = None) -> set[str]:
    """Absolute names of every module `path` imports: plain and relative
    imports, and `importlib.import_module` / `__import__` of a literal name."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.add(node.module)
                continue
            base = _package_of(path)
            if node.level - 1 > len(base):
                raise AssertionError(f"{path}: relative import beyond the top-level package")
            base = base[:len(base) - (node.level - 1)]
            if node.module:
                names.add(".".join(base + node.module.split(".")))
            else:  # from . import x: x is a module of that package (or a name in it)
                names.update(".".join(base + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("import_module", "__import__"):
                names.add(node.args[0].value)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


RULES = [
    ("ipc", ("engine", "workers", "tools")),
    ("workers", ("engine", "tools")),
    ("engine/core", ("zmq", "posix_ipc", "signal", "time", "threading", "asyncio", "socket", "mmap", "datetime",
                     "http", "urllib", "h11", "httpx", "aiohttp", "starlette", "uvicorn", "engine.daemon")),
]


@pytest.mark.parametrize("package,forbidden", RULES, ids=[r[0] for r in RULES])
def test_layering(package: str, forbidden: tuple[str, ...]) -> None:
    files = _modules(package)
    assert files, f"no modules under {package}"
    offenders = []
    for path in files:
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_rule_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import zmq\nfrom engine.core import scheduler\n")
    assert {"zmq", "engine.core"} <= _imports(bad)


def test_rule_checker_resolves_relative_and_dynamic_imports() -> None:
    # A module placed inside the tree (relative imports resolve against its path), given as a string.
    path = ROOT / "ipc" / "_probe_not_a_module.py"
    src = ("from ..engine.core import scheduler\nfrom . import ring\nfrom .records import Job\n"
           "import importlib\nimportlib.import_module('engine.daemon.loop')\n__import__('workers.main')\n")
    assert {"engine.core", "ipc.ring", "ipc.records", "engine.daemon.loop", "workers.main"} <= _imports(path, src)


# -- the daemon's layout (docs/architecture.md, "engine/daemon") --------------------------------------
DAEMON = ROOT / "engine" / "daemon"
LOOP = "engine.daemon.loop"
LOOP_BUILDERS = ("engine/daemon/main.py", "engine/daemon/loop.py")  # the construction site, and the loop itself


def _module_name(path: Path) -> str:
    parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """`_imports`, plus `from pkg import mod` read as pkg.mod (TYPE_CHECKING imports count too)."""
    names = _imports(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", ["engine/daemon/generations.py", "engine/daemon/views.py"])
def test_the_generations_registry_and_the_views_import_no_zmq(module: str) -> None:
    offenders = [n for n in _imports(ROOT / module) if n == "zmq" or n.startswith("zmq.")]
    assert not offenders, f"{module} imports {offenders}"


def test_only_the_construction_site_imports_the_loop() -> None:
    offenders = []
    for package in ("engine", "workers", "ipc", "tools"):
        for path in _modules(package):
            rel = str(path.relative_to(ROOT))
            if rel not in LOOP_BUILDERS and LOOP in _imported_modules(path):
                offenders.append(f"{rel} imports {LOOP}")
    assert not offenders, "\n".join(offenders)


def test_no_import_cycle_among_the_daemon_modules() -> None:
    graph = {_module_name(p): set() for p in sorted(DAEMON.rglob("*.py"))}
    for path in sorted(DAEMON.rglob("*.py")):
        graph[_module_name(path)] = {n for n in _imported_modules(path) if n in graph} - {_module_name(path)}
    done: set[str] = set()

    def visit(m: str, trail: list[str]) -> None:
        if m in trail:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(m):] + [m]))
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, trail + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
