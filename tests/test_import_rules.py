"""The layering rules (docs/architecture.md#layout), checked on the source itself.

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
           "import importlib\nimportlib.import_module('engine.daemon.daemon')\n__import__('workers.main')\n")
    assert {"engine.core", "ipc.ring", "ipc.records", "engine.daemon.daemon", "workers.main"} <= _imports(path, src)


# --- import cycles -------------------------------------------------------------------------------------------

CYCLE_NOTE = "import-cycle:"  # a module that must stay in a cycle says why on a line with this marker
TREE = ("engine", "ipc", "workers", "tools")


def _module_name(path: Path) -> str:
    parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module → the tree's modules it imports anywhere in its body (function-local and TYPE_CHECKING
    imports included: a cycle hidden by either is still a cycle of responsibilities). `from a import b`
    names the module a.b when it exists, else a."""
    modules = {_module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = _package_of(path)[:len(_package_of(path)) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets.update(subs or [base])
        targets.update(n for n in _imports(path) if n in modules)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    paths = [p for package in TREE for p in _modules(package)]
    graph = _import_graph(paths)
    by_name = {_module_name(p): p for p in paths}
    unexplained = [c for c in _cycles(graph) if not any(CYCLE_NOTE in by_name[m].read_text() for m in c)]
    assert not unexplained, "import cycles (break them, or say why in the module with '" + CYCLE_NOTE + "'):\n" \
        + "\n".join(" <-> ".join(c) for c in unexplained)


def test_cycle_checker_sees_a_cycle_hidden_by_type_checking(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    # and through the parser: a TYPE_CHECKING import is an edge like any other
    probe = ROOT / "engine" / "daemon" / "_probe.py"
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.daemon.daemon import Daemon\n"
    assert "engine.daemon.daemon" in _imports(probe, src)


def _private_engine_names(path: Path, source: str | None = None) -> set[str]:
    """`engine.x._name` for every underscore name (module or attribute) `path` imports from engine."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    out: set[str] = set()

    def private(part: str) -> bool:
        return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names
                       if a.name.split(".")[0] == "engine" and any(map(private, a.name.split("."))))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "engine":
            parts = node.module.split(".")
            out.update(f"{node.module}.{a.name}" for a in node.names
                       if private(a.name) or any(map(private, parts)))
    return out


# Outside engine/, engine is used through its public names only, so engine can rename its internals freely.
@pytest.mark.parametrize("package", ["tools", "workers", "ipc"])
def test_no_private_engine_names_outside_engine(package: str) -> None:
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in _modules(package) for name in sorted(_private_engine_names(path))]
    assert not offenders, "\n".join(offenders)


def test_private_name_checker_sees_a_private_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from engine.daemon.main import _pairs, main\nimport engine._hidden.mod\n"
                   "from engine import __version__\n")
    assert _private_engine_names(bad) == {"engine.daemon.main._pairs", "engine._hidden.mod"}


# -- the daemon's layout (docs/architecture.md, "engine/daemon") --------------------------------------
LOOP = "engine.daemon.daemon"
LOOP_BUILDERS = ("engine/daemon/main.py", "engine/daemon/daemon.py")  # the construction site; Daemon and its loop


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


def _imports_a_conftest(path: Path) -> bool:
    return any(n == "conftest" or n.endswith(".conftest") for n in _imports(path))


def test_no_test_module_imports_a_conftest() -> None:
    """With a conftest.py per folder, the module named `conftest` is whichever one pytest imported last;
    helpers live in plain modules beside the tests (daemon_procs, waiting, fake_server, repo_root, ...)."""
    assert [str(p.relative_to(ROOT)) for p in _modules("tests") if _imports_a_conftest(p)] == []


def test_conftest_import_checker_sees_one(tmp_path: Path) -> None:
    for i, line in enumerate(["from conftest import ROOT", "from tests.conftest import wait_until", "import conftest"]):
        (tmp_path / f"test_{i}.py").write_text(line + "\n")
        assert _imports_a_conftest(tmp_path / f"test_{i}.py"), line
    (tmp_path / "test_ok.py").write_text("from waiting import wait_until\n")
    assert not _imports_a_conftest(tmp_path / "test_ok.py")
