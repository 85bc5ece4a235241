"""`npuserve serve --config` with each bad example config: exits non-zero with the expected message."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import orjson
import psutil
import pytest

from daemon_procs import shm_objects_of
from repo_root import ROOT
from waiting import log_events

pytestmark = pytest.mark.integration

CONFIG_DIR = os.path.join(ROOT, "tests", "configs")
BAD = sorted(glob.glob(os.path.join(CONFIG_DIR, "bad_*.toml")))


def _expectation(path: str) -> str:
    with open(path) as fh:
        first = fh.readline()
    assert first.startswith("# expect: "), f"{path} lacks its '# expect:' line"
    return first[len("# expect: "):].strip()


def test_there_are_bad_examples():
    assert len(BAD) >= 10


def test_each_bad_config_fails_start_up_with_its_message(short_dir):
    procs = []
    for i, path in enumerate(BAD):
        rt = os.path.join(short_dir, f"r{i}")
        cmd = [sys.executable, "-m", "engine.daemon.main", "--config", path, "--backend", "stub", "--chips", "1",
               "--runtime-dir", rt, "--endpoint", f"ipc://{rt}/d.sock"]
        procs.append((path, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    failures = []
    for path, p in procs:
        out, err = p.communicate(timeout=120)
        text = (out + err).decode(errors="replace")
        want = _expectation(path)
        failed = [e for e in log_events(text) if e["event"] == "startup_failed"]  # the one line naming the cause
        # docs/configuration.md: a configuration error exits 2
        if p.returncode != 2 or len(failed) != 1 or want not in failed[0]["message"]:
            failures.append(f"{os.path.basename(path)}: exit {p.returncode}, wanted {want!r} in:\n{text[-800:]}")
        if "Traceback" in text:
            failures.append(f"{os.path.basename(path)}: printed a traceback:\n{text[-800:]}")
        if shm_objects_of(p.pid):
            failures.append(f"{os.path.basename(path)}: left shared memory {shm_objects_of(p.pid)}")
    assert not failures, "\n\n".join(failures)


def test_a_valid_flag_cannot_be_a_bad_value(short_dir):
    p = subprocess.run([sys.executable, "-m", "engine.daemon.main", "--backend", "stub", "--chips", "0",
                        "--runtime-dir", short_dir], cwd=ROOT, capture_output=True, timeout=60)
    assert p.returncode == 2
    assert b"board.chips" in p.stderr


def test_a_package_that_cannot_load_fails_start_up_with_the_workers_message(short_dir):
    missing = f"{short_dir}/no-such-package"
    p = subprocess.Popen([sys.executable, "-m", "engine.daemon.main", "--backend", "ref", "--chips", "1",
                          "--package", missing, "--runtime-dir", short_dir], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert b"cannot start" in err and b"no-such-package" in err, err[-2000:]
    assert shm_objects_of(p.pid) == []


def test_executor_worker_spin_reaches_every_chip_worker(daemon):
    d = daemon(backend="stub", chips=2, settings={"executor.worker_spin_us": 50})
    workers = [p for p in psutil.Process(d.pid).children() if "workers" in p.cmdline()]
    assert len(workers) == 2
    assert [orjson.loads(p.cmdline()[-1])["job_spin_s"] for p in workers] == [50e-6, 50e-6]
