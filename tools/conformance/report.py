"""The verdict of a run: a table for people, JSON Lines (tools/json_lines.py's convention) for programs."""

from __future__ import annotations

from typing import IO

from tools.conformance.runner import Result, Run
from tools.json_lines import emit

MARK = {"pass": "pass", "fail": "FAIL", "skip": "skip"}


def table_line(r: Result, width: int = 28) -> str:
    return f"{r.name.ljust(width)}  {MARK[r.status]:<4}  {r.duration_s:6.2f}s  {r.detail}"


def summary_line(run: Run) -> str:
    t = run.target
    what = f"{t.kind}, model vocab {t.vocab_size}, max_seq {t.max_seq}, text {t.text}" if t else "unreachable"
    verdict = "conforms" if run.ok else "DOES NOT CONFORM"
    return (f"{run.endpoint} ({what}): {verdict} -- {run.count('pass')} passed, {run.count('fail')} failed, "
            f"{run.count('skip')} skipped")


def json_row(r: Result, out: IO[str]) -> None:
    emit("row", {"check": r.name, "status": r.status, "detail": r.detail, "duration_s": round(r.duration_s, 3),
                 "needs": r.needs}, out)


def json_summary(run: Run, out: IO[str]) -> None:
    t = run.target
    emit("summary", {"endpoint": run.endpoint, "endpoint_kind": t.kind if t else None, "ok": run.ok,
                     "passed": run.count("pass"), "failed": run.count("fail"), "skipped": run.count("skip"),
                     "failures": [r.name for r in run.results if r.status == "fail"]}, out)
