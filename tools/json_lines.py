"""The one `--json` convention of the `npuserve` CLI: JSON Lines on stdout.

* stdout carries only JSON: one object per line (orjson, UTF-8), flushed per
  line so a reader can follow a long run;
* a command that prints several kinds of object tags each with a first key
  `"kind"` (`"row"` for a table row, `"summary"` for the verdict or the
  comparison that follows the rows, `"sample"` for a periodic sample,
  `"scenario"` for a chaos scenario, `"verdict"` for a soak's end);
* keys are snake_case with the unit in the name (`_ms`, `_s`, `tokens_per_s`);
  a value that was not measured is `null`, never left out;
* progress bars and human text go to stderr.
"""

from __future__ import annotations

import sys
from typing import IO

import orjson


def emit(kind: str, obj: dict, out: IO[str] | None = None) -> None:
    """Write `{"kind": kind, **obj}` as one line."""
    out = out or sys.stdout
    out.write(orjson.dumps({"kind": kind, **obj}).decode() + "\n")
    out.flush()
