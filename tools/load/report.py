"""From request records to numbers: percentiles, throughput, SLO goodput, the Pareto frontier, the table; and
`publish`, the one way a benchmark prints them (JSON Lines by kind, or text) and sets its exit status."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tools.load.runner import Record


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank, as `engine.sim` reports it), rounded to µs; None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(len(xs) * q))], 3)


@dataclass(frozen=True)
class Slo:
    """`ttft=500ms,tpot=25ms`: a request meets the SLO when it finished and both held."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Slo":
        vals: dict[str, float] = {}
        for part in text.split(","):
            k, _, v = part.partition("=")
            k, v = k.strip(), v.strip().lower()
            if k not in ("ttft", "tpot") or not v:
                raise ValueError(f"--slo {text!r}: expected ttft=500ms,tpot=25ms (either or both)")
            scale = 1000.0 if v.endswith("s") and not v.endswith("ms") else 1.0
            try:
                vals[f"{k}_ms"] = float(v.removesuffix("ms").removesuffix("s")) * scale
            except ValueError:
                raise ValueError(f"--slo {text!r}: {v!r} is not a duration like 500ms or 0.5s") from None
        return cls(**vals)

    def met(self, r: Record) -> bool:
        if r.error is not None:
            return False
        if self.ttft_ms is not None and (r.ttft_ms is None or r.ttft_ms > self.ttft_ms):
            return False
        if self.tpot_ms is not None and r.tpot_ms is not None and r.tpot_ms > self.tpot_ms:
            return False
        return True

    def __str__(self) -> str:
        parts = [f"ttft={self.ttft_ms:g}ms"] if self.ttft_ms is not None else []
        parts += [f"tpot={self.tpot_ms:g}ms"] if self.tpot_ms is not None else []
        return ",".join(parts)


def summarize(records: list[Record], slo: Slo | None = None) -> dict:
    """The row of one run: counts, tokens/s and requests/s over the window, TTFT/TPOT percentiles, goodput."""
    ok = [r for r in records if r.error is None]
    t_begin = min((r.sent for r in records), default=0.0)
    t_end = max(((r.last or r.sent) for r in records), default=0.0)
    window = max(t_end - t_begin, 1e-9)
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    codes: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            codes[str(r.error)] = codes.get(str(r.error), 0) + 1
    row = {
        "requests": len(records), "errors": len(records) - len(ok), "error_codes": codes,
        "generated_tokens": tokens, "seconds": round(window, 3),
        "tokens_per_s": round(tokens / window, 1), "requests_per_s": round(len(ok) / window, 3),
        "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9), "ttft_p99_ms": pct(ttft, 0.99),
        "tpot_p50_ms": pct(tpot, 0.5), "tpot_p99_ms": pct(tpot, 0.99),
    }
    if any(r.itl_ms is not None for r in ok):  # gaps between token events, pooled over the requests
        itl = [g for r in ok for g in (r.itl_ms or ())]
        row.update(itl_p50_ms=pct(itl, 0.5), itl_p99_ms=pct(itl, 0.99))
    if slo is not None:
        good = [r for r in records if slo.met(r)]
        row.update(slo=str(slo), slo_met=len(good), goodput_requests_per_s=round(len(good) / window, 3),
                   goodput_tokens_per_s=round(sum(r.tokens for r in good) / window, 1))
    tenants = sorted({r.tenant for r in records})
    if len(tenants) > 1:
        row["tenants"] = {t: summarize([r for r in records if r.tenant == t]) for t in tenants}
        for t in row["tenants"].values():
            t.pop("error_codes", None)
    return row


def pareto(rows: list[dict], x: str = "ttft_p99_ms", y: str = "tokens_per_s") -> list[dict]:
    """The rows no other row beats on both lower `x` and higher `y` (the frontier), by ascending `x`."""
    pts = [r for r in rows if r.get(x) is not None and r.get(y) is not None]
    front = [r for r in pts if not any((o[x] <= r[x] and o[y] > r[y]) or (o[x] < r[x] and o[y] >= r[y])
                                       for o in pts)]
    return sorted(front, key=lambda r: r[x])


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return str(v)


# The columns of the table `npuserve bench` prints, (key, header).
COLUMNS = [("label", "run"), ("round", "round"), ("concurrency", "conc"), ("rate", "rate/s"), ("requests", "reqs"),
           ("errors", "err"), ("tokens_per_s", "tok/s"), ("predicted_tokens_per_s", "pred tok/s"),
           ("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("predicted_ttft_p99_ms", "pred p99"),
           ("tpot_p50_ms", "TPOT p50"), ("tpot_p99_ms", "TPOT p99"), ("itl_p50_ms", "ITL p50"),
           ("itl_p99_ms", "ITL p99"),
           ("goodput_requests_per_s", "good req/s"), ("goodput_tokens_per_s", "good tok/s"),
           ("pareto", "frontier")]


def table(rows: list[dict], columns: list[tuple[str, str]] = COLUMNS) -> str:
    """A plain-text table of the `columns` (key, header) any row has (ms for latencies)."""
    cols = [(k, h) for k, h in columns if any(r.get(k) not in (None, "") for r in rows)]
    cells = [[h for _, h in cols]] + [[_fmt(r.get(k)) if k != "pareto" else ("*" if r.get(k) else "")
                                       for k, _ in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def publish(prog: str, as_json: bool, lines: Iterable[tuple[str, dict]], text: Callable[[], str],
            runs: Iterable[dict] = (), errors_key: str = "errors") -> int:
    """A benchmark's output, one way for all: JSON Lines (`lines`, each `(kind, object)`) or the human `text()`;
    then the exit status, 1 when any of `runs` had failed requests (counted in `errors_key`), said on stderr."""
    if as_json:
        from tools.json_lines import emit

        for kind, obj in lines:
            emit(kind, obj)
    else:
        print(text())
    errors = sum(r.get(errors_key) or 0 for r in runs)
    if errors:
        print(f"{prog}: {errors} requests failed (see error_codes)", file=sys.stderr)
    return 0 if errors == 0 else 1
