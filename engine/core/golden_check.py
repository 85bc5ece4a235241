"""Golden checks: does a served model reproduce a package's golden cases? (pure; no I/O)

A package's `golden.json` holds cases `{"name", "prompt": [ids], "max_tokens", "tokens", "temperature",
"ignore_eos", "min_top2_gap"?, "seed"?}` whose `tokens` were computed by an oracle (the cache-free
recompute for `.npz` packages, llama.cpp alone for imported GGUFs). Whoever runs them (the `npuserve
golden` CLI against an endpoint, the daemon on a new generation before it publishes it) sends
`golden_request(case)` and hands the outcome here; `check_cases` says pass/fail per case, with a reason.

How each field is respected:
* `ignore_eos` (default true, how the oracles ran): the tokens must match exactly and finish `length`.
  When false, the expected output stops before the first EOS id, which then is the finish (`eos`).
* `temperature` (default 0 = greedy) and `seed`: sent as they are; a sampled case without a seed cannot
  be reproduced and is skipped, never passed.
* `min_top2_gap`: the smallest gap between the two best logits the oracle saw. Two correct
  implementations can round a near-tie differently, so a mismatching case whose gap is below the
  caller's `tie_gap` is skipped as inconclusive (default 0: every mismatch fails).
A report passes when no case fails and at least one case passed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

# Sampling fields a case may set beside temperature, sent through unchanged.
_SAMPLING_KEYS = ("top_p", "top_k", "seed")


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Outcome:
    """What running one case produced: its tokens and finish reason, or the error that ended it."""

    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class CaseVerdict:
    name: str
    status: Status
    reason: str  # "" when it passed
    expected: tuple[int, ...]
    got: tuple[int, ...] | None

    @property
    def ok(self) -> bool:
        return self.status is not Status.FAIL

    def to_dict(self) -> dict:
        return {"case": self.name, "status": self.status.value, "reason": self.reason,
                "expected": list(self.expected), "got": None if self.got is None else list(self.got)}


@dataclass(frozen=True)
class GoldenReport:
    verdicts: tuple[CaseVerdict, ...]

    def count(self, status: Status) -> int:
        return sum(v.status is status for v in self.verdicts)

    @property
    def ok(self) -> bool:
        return self.count(Status.FAIL) == 0 and self.count(Status.PASS) > 0

    @property
    def summary(self) -> str:
        p, f, s = (self.count(x) for x in Status)
        text = f"{p}/{len(self.verdicts)} golden cases passed" + (f", {f} failed" if f else "") + \
            (f", {s} skipped" if s else "")
        if not self.verdicts:
            text = "the package has no golden cases: nothing shows the model is served correctly"
        elif not p and not f:
            text += ": none was conclusive"
        return text

    def first_failure(self) -> CaseVerdict | None:
        return next((v for v in self.verdicts if v.status is Status.FAIL), None)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "cases": len(self.verdicts), "passed": self.count(Status.PASS),
                "failed": self.count(Status.FAIL), "skipped": self.count(Status.SKIP), "summary": self.summary}


def case_name(case: dict, index: int) -> str:
    return str(case.get("name") or f"case{index}")


def golden_request(case: dict) -> dict:
    """The generate fields that run `case` (prompt ids, max_tokens, ignore_eos, sampling as recorded)."""
    req = {"prompt": [int(t) for t in case["prompt"]], "max_tokens": int(case["max_tokens"]),
           "ignore_eos": bool(case.get("ignore_eos", True)), "temperature": float(case.get("temperature", 0.0))}
    req.update({k: case[k] for k in _SAMPLING_KEYS if case.get(k) is not None})
    return req


def expected_outcome(case: dict, eos_ids: Sequence[int]) -> tuple[tuple[int, ...], str]:
    """The tokens and finish reason a correct server produces for `case` (EOS is not emitted)."""
    tokens = tuple(int(t) for t in case["tokens"])
    if case.get("ignore_eos", True):
        return tokens, "length"
    eos = set(int(e) for e in eos_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i], "eos"
    return tokens, "length"


def _divergence(expected: Sequence[int], got: Sequence[int]) -> str:
    for i, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            return f"token {i}: expected {e}, got {g}"
    if len(got) < len(expected):
        return f"{len(got)} tokens, expected {len(expected)} (next expected {expected[len(got)]})"
    return f"{len(got)} tokens, expected {len(expected)} (extra {got[len(expected)]} at {len(expected)})"


def check_case(case: dict, outcome: Outcome, eos_ids: Sequence[int], *, name: str = "case",
               tie_gap: float = 0.0) -> CaseVerdict:
    """One case's verdict; `eos_ids` are the served model's (they matter only when `ignore_eos` is false)."""
    expected, finish = expected_outcome(case, eos_ids)
    got = None if outcome.error is not None else tuple(int(t) for t in outcome.tokens)

    def verdict(status: Status, reason: str = "") -> CaseVerdict:
        return CaseVerdict(name, status, reason, expected, got)

    if float(case.get("temperature", 0.0)) > 0.0 and case.get("seed") is None:
        return verdict(Status.SKIP, f"sampled at temperature {case['temperature']} without a seed: "
                                    f"not reproducible")
    if outcome.error is not None:
        return verdict(Status.FAIL, f"request failed: {outcome.error}")
    if got != expected:
        why = _divergence(expected, got)
        gap = case.get("min_top2_gap")
        if isinstance(gap, (int, float)) and not isinstance(gap, bool) and gap < tie_gap:
            return verdict(Status.SKIP, f"{why}; but the oracle's smallest top-2 logit gap was {gap} "
                                        f"(< {tie_gap}): a near-tie, inconclusive")
        return verdict(Status.FAIL, why)
    if outcome.finish_reason != finish:
        return verdict(Status.FAIL, f"finish_reason {outcome.finish_reason!r}, expected {finish!r}")
    return verdict(Status.PASS)


def check_cases(cases: Sequence[dict], outcomes: Sequence[Outcome], eos_ids: Sequence[int], *,
                tie_gap: float = 0.0) -> GoldenReport:
    """Verdicts of `cases` given `outcomes` (same order and length)."""
    assert len(cases) == len(outcomes), (len(cases), len(outcomes))
    return GoldenReport(tuple(check_case(c, o, eos_ids, name=case_name(c, i), tie_gap=tie_gap)
                              for i, (c, o) in enumerate(zip(cases, outcomes))))
