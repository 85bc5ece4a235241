"""The soak's steady mixed load: what each request is, and what its answer must be.

Requests are drawn from a fixed pool of templates (prompt, length, seed,
sampling), so the expected tokens of each template are computed once -- by
`workers.oracle.Oracle` for `ref`, from the stub's (seed, position) hash for
`stub`/`sim` -- and every completion is compared with them. Each send gives
a template a kind:

* `normal`, `prefix` (one of a few shared system prompts), `long` (a prompt of
  about half the context): must end `done` / `length` with exactly the
  expected tokens;
* `cancel`: cancelled after a random number of tokens; must end `done`
  (`cancelled`, or `length` if it won the race) with a prefix of them;
* `deadline`: a deadline of a few ms; must end `done` / `length` with the
  expected tokens or `error` 504, having streamed a prefix of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = {"normal": 45, "prefix": 20, "cancel": 15, "deadline": 10, "long": 10}
TENANTS = ("default", "batch", "interactive")


@dataclass(frozen=True)
class Template:
    key: int
    kind_hint: str  # prefix / long / plain: how the prompt was built
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int
    temperature: float
    top_k: int
    top_p: float

    def fields(self) -> dict:
        return dict(max_tokens=self.max_tokens, seed=self.seed, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, ignore_eos=True)


HINTS = ("prefix", "long", "plain", "plain")  # how the pool's prompts are built, in turn


class TemplateMaker:
    """Makes templates: prompt ids drawn from 1..`prompt_ids`-1 (EOS excluded, below the vocabulary), up to
    `max_tokens` output tokens each; `long` prompts of `long_prompt`/2..`long_prompt` tokens (at most half
    the context); `prefix` prompts one of three shared 48-token system prompts and a short tail."""

    def __init__(self, model: dict, seed: int = 7, max_tokens: int = 32, prompt_ids: int = 256,
                 long_prompt: int = 1024) -> None:
        self.rng = random.Random(seed)
        self.model = model
        self.max_tokens = max_tokens
        vocab = min(model["vocab_size"], prompt_ids)
        eos = set(model.get("eos_ids") or [])
        self.ids = [t for t in range(1, vocab) if t not in eos]
        self.systems = [[self.tok() for _ in range(48)] for _ in range(3)]  # three full-block shared prefixes
        self.long_len = max(min(64, long_prompt), min(long_prompt, model["max_seq"] // 2))
        self.made = 0

    def tok(self) -> int:
        return self.rng.choice(self.ids)

    def make(self, hint: str) -> Template:
        rng, i = self.rng, self.made
        self.made += 1
        if hint == "prefix":
            prompt = self.systems[i % 3] + [self.tok() for _ in range(rng.randrange(1, 12))]
        elif hint == "long":
            prompt = [self.tok() for _ in range(rng.randrange(self.long_len // 2, self.long_len))]
        else:
            prompt = [self.tok() for _ in range(rng.randrange(1, 40))]
        g = rng.randrange(1, self.max_tokens + 1)
        g = max(1, min(g, self.model["max_seq"] - len(prompt)))
        return Template(i, hint, tuple(prompt), g, rng.randrange(1 << 32), rng.choice([0.0, 0.7, 1.0]),
                        rng.choice([0, 20]), rng.choice([1.0, 0.9]))


def templates(model: dict, n: int = 64, seed: int = 7, max_tokens: int = 32,
              prompt_ids: int = 256, long_prompt: int = 1024, maker: TemplateMaker | None = None) -> list[Template]:
    """The pool: `n` templates of `maker` (default: a new one with these parameters), their hints in turn."""
    maker = maker or TemplateMaker(model, seed, max_tokens, prompt_ids, long_prompt)
    return [maker.make(HINTS[i % len(HINTS)]) for i in range(n)]


def pick(rng: random.Random, pool: list[Template], fresh: TemplateMaker | None = None
         ) -> tuple[Template, str, dict]:
    """(template, kind, extra wire fields + load options) of the next request; with `fresh`, a new template
    (never sent before: a new prompt and seed) instead of one of the pool."""
    kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
    if fresh is not None:
        t = fresh.make(kind if kind in ("prefix", "long") else rng.choice(HINTS))
    elif kind in ("prefix", "long"):
        t = rng.choice([t for t in pool if t.kind_hint == kind])
    else:
        t = rng.choice(pool)
    extra: dict = {"tenant": rng.choice(TENANTS)}
    if kind == "cancel":
        extra["cancel_after"] = rng.randrange(0, max(1, t.max_tokens))
    elif kind == "deadline":
        extra["deadline_ms"] = rng.randrange(1, 40)
    return t, kind, extra


class Expected:
    """The tokens each template must produce, computed once per template."""

    def __init__(self, model: dict, use_oracle: bool, package: str | None = None) -> None:
        self.model = model
        self.backend = model.get("backend")
        self.enabled = use_oracle and self.backend in ("ref", "stub", "sim")
        self._oracle = None
        self._package = package
        self._cache: dict[int, list[int]] = {}

    def tokens(self, t: Template, keep: bool = True) -> list[int] | None:
        """The tokens `t` must produce; `keep=False` for a template sent once (not cached)."""
        if not self.enabled:
            return None
        got = self._cache.get(t.key)
        if got is None:
            got = self._compute(t)
            if keep:
                self._cache[t.key] = got
        return got

    def _compute(self, t: Template) -> list[int]:
        if self.backend == "ref":
            if self._oracle is None:
                from workers.oracle import Oracle

                self._oracle = Oracle(self._package)
            toks, _ = self._oracle.run(list(t.prompt), t.max_tokens, t.temperature, t.top_p, t.top_k, t.seed,
                                       ignore_eos=True)
            return toks
        import numpy as np

        from workers.backends.stub import stub_tokens

        pos = np.arange(t.max_tokens) + len(t.prompt)
        return stub_tokens(np.full(t.max_tokens, t.seed), pos, self.model["vocab_size"],
                           tuple(self.model["eos_ids"])).tolist()


def check(tr, t: Template, expected: list[int] | None, allow_codes: frozenset[int] = frozenset()) -> list[str]:
    """Violations of one finished request (empty = it behaved): the wire's promises (`Trace.wire_violations`),
    then the finish this kind of request may have (an error in `allow_codes` is allowed: a fault's), then the
    tokens against `expected`."""
    v = tr.wire_violations()
    if tr.unexpected:
        v.append(f"unexpected event(s) {[e.get('ev') for e in tr.unexpected][:3]}")
    term = tr.terminal
    if term is None:
        return v
    if term["ev"] == "done":
        reason = term.get("finish_reason")
        allowed = {"cancel": ("cancelled", "length"), "deadline": ("length",)}.get(tr.kind, ("length",))
        if reason not in allowed:
            v.append(f"finish_reason {reason!r} for a {tr.kind} request")
    else:
        code = term.get("code")
        if not (tr.kind == "deadline" and code == 504) and code not in allow_codes:
            v.append(f"error {code} {term.get('reason')} for a {tr.kind} request")
    if expected is not None:
        complete = term["ev"] == "done" and term.get("finish_reason") == "length"
        want = expected if complete else expected[:len(tr.tokens)]
        if tr.tokens != want:
            i = next((k for k, (a, b) in enumerate(zip(tr.tokens, want)) if a != b), min(len(tr.tokens), len(want)))
            v.append(f"crosstalk: tokens differ from the request run alone at position {i} "
                     f"(got {tr.tokens[i:i + 3]}, want {want[i:i + 3]})")
    return v
