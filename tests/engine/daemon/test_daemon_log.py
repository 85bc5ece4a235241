"""Log lines: one JSON object per line with a catalogued `event`, or a human format; levels filter."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import orjson

from repo_root import ROOT
from engine.daemon import log as daemon_log
from engine.daemon.log import EVENTS, LEVELS, human_line, json_line

_LOG_CALL = re.compile(r"""\blog\(\s*["']([A-Za-z0-9_.]+)["']""")


def _events_in_code() -> set[str]:
    found = set()
    for path in glob.glob(os.path.join(ROOT, "engine", "**", "*.py"), recursive=True):
        with open(path) as fh:
            found |= set(_LOG_CALL.findall(fh.read()))
    return found


def test_every_event_the_code_logs_is_catalogued_and_every_catalogued_one_is_logged():
    used = _events_in_code()
    assert used - set(EVENTS) == set(), "log events missing from engine/daemon/log.py EVENTS"
    assert set(EVENTS) - used == set(), "catalogued events nothing logs"
    assert all(level in LEVELS for level in EVENTS.values())


def test_the_operations_page_documents_every_event_with_its_level():
    with open(os.path.join(ROOT, "docs", "operations.md")) as fh:
        text = fh.read()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (debug|info|warning|error) \|", text, re.M))
    assert rows == EVENTS


def test_json_lines_are_one_object_each():
    line = json_line(1700000000.1234, "warning", "chip_down", {"chip": 1, "reason": "a\nb", "odd": object()})
    assert b"\n" not in line
    rec = orjson.loads(line)
    assert rec["event"] == "chip_down" and rec["level"] == "warning" and rec["ts"] == 1700000000.123
    assert rec["reason"] == "a\nb" and rec["odd"].startswith("<object")


def test_human_lines_read_as_time_level_event_and_pairs():
    line = human_line(1700000000.5, "info", "serving", {"board": "0", "endpoints": ["ipc:///x y"], "chips": 2,
                                                       "traceback": "Traceback...\n  boom\n"}).decode()
    first, *rest = line.split("\n")
    assert re.fullmatch(r'\d\d:\d\d:\d\d\.500 INFO  serving board=0 endpoints=\["ipc:///x y"\] chips=2', first), first
    assert rest == ["Traceback...", "  boom"]


def test_human_levels_are_the_short_names_in_one_column():
    labels = [human_line(1700000000.0, level, "serving", {}).decode().split(" ")[1] for level in LEVELS]
    assert labels == ["DEBUG", "INFO", "WARN", "ERROR"]
    assert all(human_line(1700000000.0, level, "serving", {}).decode()[19:26] == "serving" for level in LEVELS)


def test_the_level_filters_lines(capfd):
    try:
        daemon_log.configure("warning", "json")
        daemon_log.log("serving", board="0")
        daemon_log.log("chip_down", chip=0)
        err = capfd.readouterr().err.splitlines()
        assert [orjson.loads(x)["event"] for x in err] == ["chip_down"]
        daemon_log.configure("info", "human")
        daemon_log.log("serving", board="0")
        assert " INFO  serving board=0" in capfd.readouterr().err
    finally:
        daemon_log.configure("info", "json")


def test_log_format_human_from_the_command_line(short_dir):
    p = subprocess.run([sys.executable, "-m", "engine.daemon.main", "--backend", "stub", "--chips", "0",
                        "--runtime-dir", short_dir, "--log-format", "human"], cwd=ROOT, capture_output=True,
                       timeout=60)
    assert p.returncode == 2
    [line] = p.stderr.decode().splitlines()
    assert re.match(r"\d\d:\d\d:\d\d\.\d{3} ERROR startup_failed exit_code=2 message=\"configuration error: "
                    r"board.chips: must be an int in \[1, 64\], got 0\"", line), line
