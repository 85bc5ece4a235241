"""`npuserve install-monitoring`: the four files, promtool's checks and unit tests on them, the flags, and the
docs' alert list against the rules file."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from repo_root import ROOT
from tools.cli import main as cli_main

PROMTOOL = shutil.which("promtool") or shutil.which("promtool", path="/usr/bin")  # Debian puts it there
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install "
                                                              "prometheus; .ci/run installs it)")


def write(tmp_path, *flags: str) -> str:
    out = str(tmp_path / "mon")
    assert cli_main(["install-monitoring", "--out", out, "--host", "h1", *flags]) == 0
    return out


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=300)


def load_yaml(path: str) -> dict:
    with open(path) as fh:
        return yaml.safe_load(fh)


def alerts_of(out: str) -> dict[str, dict]:
    rules = load_yaml(os.path.join(out, "npuserve.rules.yml"))
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The files as written with every default."""
    return write(tmp_path_factory.mktemp("shipped"))


def test_one_command_writes_the_four_files(shipped):
    assert sorted(os.listdir(shipped)) == sorted(["prometheus.yml", "npuserve.rules.yml", "npuserve.rules.test.yml",
                                                   "grafana-dashboard.json"])
    dash = json.load(open(os.path.join(shipped, "grafana-dashboard.json")))
    assert {v["name"] for v in dash["templating"]["list"]} >= {"host", "board"}
    assert all(t["expr"] for p in dash["panels"] for t in p["targets"])


@needs_promtool
def test_promtool_accepts_the_config_and_rules_and_their_unit_tests_pass(shipped):
    for args in (("check", "config", os.path.join(shipped, "prometheus.yml")),
                 ("check", "rules", os.path.join(shipped, "npuserve.rules.yml")),
                 ("test", "rules", os.path.join(shipped, "npuserve.rules.test.yml"))):
        r = promtool(*args)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"


def test_every_alert_has_a_firing_and_a_quiet_unit_test(shipped):
    tests = load_yaml(os.path.join(shipped, "npuserve.rules.test.yml"))["tests"]
    seen: dict[str, list[bool]] = {}
    for t in tests:
        for case in t["alert_rule_test"]:
            seen.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    assert {n: sorted(v) for n, v in seen.items()} == {n: [False, True] for n in alerts_of(shipped)}


@needs_promtool
def test_the_unit_tests_catch_a_broken_alert(shipped, tmp_path):
    # the chip alert without its restart half: a worker restarted quickly (chip_up never 0) would not page
    broken = tmp_path / "broken"
    shutil.copytree(shipped, broken)
    path = broken / "npuserve.rules.yml"
    text = path.read_text()
    cut = re.sub(r" or increase\(npuserve:worker_restarts_total\{role=\"board\"\}\[\w+\]\) > 0", "", text)
    assert cut != text
    path.write_text(cut)
    r = promtool("test", "rules", str(broken / "npuserve.rules.test.yml"))
    assert r.returncode != 0 and "NpuserveChipDown" in r.stdout + r.stderr


def test_flags_set_targets_labels_and_for_durations(tmp_path):
    out = write(tmp_path, "--boards", "0,b7=10.0.0.7:9411", "--balancer", "none", "--http", "127.0.0.1:8001",
                "--for", "30s", "--for", "NpuserveBoardDown=2m", "--scrape-interval", "5s")
    prom = load_yaml(os.path.join(out, "prometheus.yml"))
    got = {(j["job_name"], tuple(c["targets"]), tuple(sorted(c["labels"].items())))
           for j in prom["scrape_configs"] for c in j["static_configs"]}
    assert got == {("npuserve-board", ("127.0.0.1:9400",), (("board", "0"), ("host", "h1"), ("role", "board"))),
                   ("npuserve-board", ("10.0.0.7:9411",), (("board", "b7"), ("host", "10.0.0.7"), ("role", "board"))),
                   ("npuserve-http", ("127.0.0.1:8001",), (("host", "h1"), ("role", "front")))}
    assert prom["global"]["scrape_interval"] == "5s" and prom["global"]["scrape_timeout"] == "5s"
    fors = {n: a["for"] for n, a in alerts_of(out).items()}
    assert fors.pop("NpuserveBoardDown") == "2m" and set(fors.values()) == {"30s"}


@pytest.mark.parametrize("flags, message", [
    (["--for", "NpuserveNope=1m"], "no such alert"),
    (["--for", "soon"], "not a duration"),
    (["--ttft-slo", "3"], "bound of the TTFT histogram"),
    (["--kv-threshold", "1.5"], "between 0 and 1"),
    (["--boards", "host-without-port"], "not HOST:PORT"),
    (["--http", "127.0.0.1:8000,127.0.0.1:8000"], "listed twice"),
    (["--rate-window", "10s", "--scrape-interval", "15s"], "at least two scrapes"),
])
def test_bad_flags_exit_2_with_a_clear_message(tmp_path, capsys, flags, message):
    assert cli_main(["install-monitoring", "--out", str(tmp_path / "x"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _docs_alert_rows() -> dict[str, tuple[str, str, str]]:
    text = open(os.path.join(ROOT, "docs", "observability.md")).read()
    section = text.split("## Monitoring a deployment", 1)[1]
    return {m.group(1): (m.group(2), m.group(3), m.group(4))
            for m in re.finditer(r"^\| `(Npuserve\w+)` \| (\w+) \| (.+?) \| (.+?) \|$", section, re.M)}


def test_the_docs_list_every_alert_with_its_severity_meaning_and_action(shipped):
    rows = _docs_alert_rows()
    alerts = alerts_of(shipped)
    assert set(rows) == set(alerts)
    for name, a in alerts.items():
        severity, meaning, action = rows[name]
        assert (severity, meaning, action) == (a["labels"]["severity"], a["annotations"]["description"],
                                               a["annotations"]["summary"]), name
    anchors = set(re.findall(r"^### (Npuserve\w+)$", open(os.path.join(ROOT, "docs", "troubleshooting.md")).read(),
                             re.M))
    for name, a in alerts.items():
        assert a["annotations"]["runbook_url"] == f"docs/troubleshooting.md#{name.lower()}"
        assert name in anchors, f"docs/troubleshooting.md has no '### {name}' section"
