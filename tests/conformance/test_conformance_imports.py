"""The conformance suite is written from the document alone: it imports nothing of npuserve's engine, codec or
workers -- only the standard library, pyzmq, orjson and its own modules."""

from __future__ import annotations

import sys
from pathlib import Path

from test_import_rules import _imports

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_TOP = {"zmq", "orjson", "__future__"}
ALLOWED_OWN = ("tools.conformance", "tools.json_lines")


def suite_files() -> list[Path]:
    return sorted((ROOT / "tools" / "conformance").rglob("*.py")) + [ROOT / "tools" / "conformance_cmd.py"]


def offenders(path: Path, source: str | None = None) -> list[str]:
    bad = []
    for name in _imports(path, source):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in ALLOWED_TOP:
            continue
        if any(name == own or name.startswith(own + ".") for own in ALLOWED_OWN):
            continue
        bad.append(name)
    return bad


def test_the_suite_imports_only_pyzmq_orjson_and_itself():
    files = suite_files()
    assert len(files) >= 8
    found = {str(p.relative_to(ROOT)): offenders(p) for p in files}
    assert not {k: v for k, v in found.items() if v}


def test_the_rule_sees_an_import_of_the_codec_the_client_or_the_workers():
    path = ROOT / "tools" / "conformance" / "wire.py"
    source = "import zmq\nfrom ipc.codec import encode\nimport engine.client\nfrom workers import oracle\n"
    assert set(offenders(path, source)) == {"ipc.codec", "engine.client", "workers"}


def test_running_the_command_loads_no_npuserve_module():
    import subprocess

    code = ("import sys, tools.conformance_cmd as m\n"
            "m.main(['--list'])\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('engine', 'ipc', 'workers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"
