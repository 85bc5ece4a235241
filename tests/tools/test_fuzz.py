"""The fuzz harnesses (tools/fuzz) keep running, and report a decoder that breaks its contract.

Each harness runs for a fixed number of executions (libFuzzer's -runs: the same work on any machine)
through the real driver (`python -m tools.fuzz`), in its own process as `make fuzz` runs it. The second
half puts a deliberately broken decoder in place (`--preload`, a module written here) and checks that the
harness finds it, names it and saves the input.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tools.fuzz import HARNESSES

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("atheris")


def _fuzz(tmp_path: Path, *args: str, pythonpath: list[Path] = ()) -> tuple[int, list[dict]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, pythonpath),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tools.fuzz", *args, "--out", str(tmp_path / "out"), "--json",
                           "--seed", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    rows = [orjson.loads(ln) for ln in proc.stdout.splitlines() if ln.strip()]
    assert rows and rows[-1]["kind"] == "summary", proc.stderr[-3000:]
    return proc.returncode, rows


@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_runs_clean(tmp_path, harness):
    rc, rows = _fuzz(tmp_path, harness, "--runs", "3000")
    row = next(r for r in rows if r["kind"] == "row")
    assert row["harness"] == harness and row["errors"] == []
    assert row["executions"] >= 3000
    assert row["findings"] == 0, [r for r in rows if r["kind"] == "finding"]
    assert rc == 0
    assert any((tmp_path / "out" / harness / "corpus").iterdir())  # the seeds, and what the run added


BROKEN = {
    # the generate op stops checking max_tokens: an accepted request out of the documented range
    "wire_request": ("import ipc.schema as s\n"
                     "s.OP_FIELDS['generate']['max_tokens'] = (lambda name, value: value, 16)\n",
                     "accepted out of range: max_tokens"),
    # the front lets max_tokens past the wire's 2^20: the daemon would refuse what the front accepted
    "http_request": ("import engine.http.openai_request as r\nr.MAX_TOKENS = 1 << 40\n",
                     "the front accepts what the wire refuses: out_of_range max_tokens"),
    # a record's kind looked up without its fallback: KeyError instead of the documented ValueError
    "job_record": ("import ipc.records as r\nr._member = lambda table, cls, value: table[value]\n", "KeyError"),
    # the event check forgets the ids' range
    "wire_event": ("import ipc.schema as s\ns.TOKEN_ID_MAX = 1 << 40\n", "accepted event of the wrong shape: tokens"),
}


@pytest.mark.parametrize("harness", sorted(BROKEN))
def test_harness_reports_a_broken_decoder(tmp_path, harness):
    source, signature = BROKEN[harness]
    (tmp_path / "fuzz_break.py").write_text(source)
    rc, rows = _fuzz(tmp_path, harness, "--runs", "200000", "--first", "--preload", "fuzz_break",
                     pythonpath=[tmp_path])
    findings = [r for r in rows if r["kind"] == "finding"]
    assert rc == 1
    assert len(findings) == 1 and signature in findings[0]["signature"], findings
    saved = Path(findings[0]["artifact"])
    assert saved.is_file() and saved.parent == tmp_path / "out" / harness / "findings"
