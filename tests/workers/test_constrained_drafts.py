"""Drafts on constrained lanes (structured output), in the worker on the tiny `ref` model: each draft row is
sampled under the grammar advanced through the drafts before it, and the matcher ends where the accepted
run leaves it."""

from __future__ import annotations

import numpy as np
import pytest

from engine.daemon.constraint_cache import ConstraintCache
from ipc.records import Job, JobKind, Lane, build_job
from workers.backends.ref import RefBackend, full_recompute_logits
from workers.draft_model import DraftModel
from workers.execute_job import execute_job
from workers.main import constraint_book
from tests.workers.ref_model_fixtures import backend, package  # noqa: F401 - fixtures

PROMPT = [256, *b"Data: "]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "size"],
    "additionalProperties": False,
}



def compiled(kind: str, body) -> tuple[int, str]:
    spec = ConstraintCache().get(kind, body)
    return spec.id, spec.grammar


class Lanes:
    """One constrained request driven as the scheduler drives it: a prefill lane with the grammar, then one
    lane per step holding the last token and, when given, drafts (a verification job)."""

    def __init__(self, key: int, cid: int, grammar: str, temperature: float, seed: int, table: list[int]):
        self.key, self.cid, self.grammar = key, cid, grammar
        self.temperature, self.seed, self.table = temperature, seed, table
        self.tokens = list(PROMPT)
        self.logprobs: list[float] = []

    def prefill(self, backend, book) -> None:
        lane = Lane(self.tokens, 0, self.table, temperature=self.temperature, seed=self.seed, want_logprobs=True,
                    constraint=self.cid, constraint_key=self.key, constraint_done=0, replay=[], grammar=self.grammar)
        out = execute_job(backend, build_job(JobKind.PREFILL, [lane]), constraints=book)
        assert not out.error, out.error
        self.tokens.append(int(out.tokens[0]))
        self.logprobs.append(float(out.logprobs[0]))

    def step(self, backend, book, drafts: list[int], draft: DraftModel | None = None):
        """One step; returns the outcome. With drafts: appends the accepted ones and the token after them
        (with `draft`, the draft model proposes them in place of `drafts`, placeholders of their length)."""
        c = {"constraint": self.cid, "constraint_key": self.key, "constraint_done": len(self.tokens) - len(PROMPT)}
        kind = JobKind.PREFILL if drafts else JobKind.DECODE  # a verification job is prefill-like
        lane = Lane(self.tokens[-1:] + drafts, len(self.tokens) - 1, self.table, temperature=self.temperature,
                    seed=self.seed, want_logprobs=True, drafts=len(drafts), draft_model=draft is not None, **c)
        job = Job.from_arrays(build_job(kind, [lane]).to_arrays(), copy=False)  # as the worker reads it
        out = execute_job(backend, job, constraints=book, draft=draft)
        assert not out.error, out.error
        a = int(out.accepted[0]) if drafts else 0
        if draft is not None:
            drafts = out.accepted_tokens.tolist()
        if drafts:
            assert out.accepted_tokens.tolist() == drafts[:a]
            self.logprobs += out.accepted_logprobs.tolist()
        self.tokens += drafts[:a] + [int(out.tokens[0])]
        self.logprobs.append(float(out.logprobs[0]))
        return out

    def output(self) -> list[int]:
        return self.tokens[len(PROMPT):]


def _table(i: int) -> list[int]:
    return [i * 16 + k for k in range(16)]


def test_a_draft_the_grammar_forbids_is_rejected_and_the_masked_token_is_next(backend, package):
    """The model's own first choice after `x`, drafted, is what an unmasked verification accepts; a grammar
    allowing only three other letters there rejects it at its row, and the lane's next token is the best of
    those three (the masked argmax). An allowed draft equal to it is accepted, then an allowed but wrong one
    rejected; and the matcher is left after the accepted run: the next step masks as a fresh replay does."""
    logits = full_recompute_logits(package, PROMPT + [ord("x")])[-1]
    top = int(np.argmax(logits))
    assert top != ord("x")
    letters = [t for t in b"abcdefgh" if t != top][:3]
    cid, grammar = compiled("regex", "x[%s]{1,2}" % bytes(letters).decode())
    best = max(letters, key=lambda t: logits[t])
    vocab = backend.describe().vocab_size

    book = constraint_book(package, backend.describe())
    r = Lanes(1, cid, grammar, 0.0, 0, _table(0))
    r.prefill(backend, book)
    assert r.output() == [ord("x")]  # forced
    out = r.step(backend, book, [top, top])
    assert int(out.accepted[0]) == 0 and r.output() == [ord("x"), best]

    # drafts: `best` (accepted), an allowed letter the model does not choose there (rejected), the forbidden
    # `top` (after a rejection: never looked at)
    row1 = full_recompute_logits(package, PROMPT + [ord("x"), best])[-1]
    best1 = max(letters, key=lambda t: row1[t])
    wrong = next(t for t in letters if t != best1)
    s = Lanes(2, cid, grammar, 0.0, 0, _table(1))
    s.prefill(backend, book)
    out = s.step(backend, book, [best, wrong, top])
    assert int(out.accepted[0]) == 1 and s.output() == [ord("x"), best, best1]
    # the matcher right after the job: fed [x, best] (the sampled token is fed by the next step), the
    # rejected draft rolled back (fed [x, best, wrong] it would allow only EOS)
    fresh = constraint_book(package, backend.describe())
    upto = s.tokens[:-1]
    rebuilt = Lane(upto, 0, s.table, constraint=cid, constraint_key=2, constraint_done=len(upto) - len(PROMPT),
                   replay=upto[len(PROMPT):], grammar=grammar)
    want = fresh.allowed(build_job(JobKind.PREFILL, [rebuilt]), np.array([0]), vocab)[0]
    st = book._states[2]  # noqa: SLF001 -- the lane's state as the job left it (a next job would first tidy it)
    assert st.consumed == 2 and st.drafted == 0
    assert (book.mask_of(st.matcher, vocab) == want).all() and want[letters].all()
    # and the next step masks as a fresh replay of the whole output does
    rebuilt = Lane(s.tokens, 0, s.table, constraint=cid, constraint_key=2, constraint_done=len(s.output()),
                   replay=s.output(), grammar=grammar)
    want = fresh.allowed(build_job(JobKind.PREFILL, [rebuilt]), np.array([0]), vocab)[0]
    nxt = Lane(s.tokens[-1:], len(s.tokens) - 1, s.table, constraint=cid, constraint_key=2,
               constraint_done=len(s.output()))
    got = book.allowed(build_job(JobKind.DECODE, [nxt]), np.array([0]), vocab)[0]
    assert (got == want).all() and not got[letters].any()


def _perturbed(rng, future: list[int], k: int, vocab: int, eos: int) -> list[int]:
    """k drafts: the plain run's next tokens, one of them (maybe) replaced by another token."""
    ds = list(future[:k])
    if ds and rng.random() < 0.7:
        j = int(rng.integers(len(ds)))
        ds[j] = int(rng.choice([rng.integers(0, 256), ord("}"), ord('"'), ord("1"), eos]))
    return ds


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 11)])
def test_drafted_constrained_output_equals_plain_decoding(backend, package, temperature, seed):
    """Drafts from the plain run's own continuation, one token in most steps replaced (a forbidden token, a
    wrong but allowed one, EOS): the drafted run is the plain run token for token, logprobs included. A
    matcher left anywhere but after the accepted run masks the next steps differently."""
    eos = package.eos_ids[0]
    vocab = backend.describe().vocab_size
    cid, grammar = compiled("json_schema", SCHEMA)
    book = constraint_book(package, backend.describe())
    plain = Lanes(1, cid, grammar, temperature, seed, _table(2))
    plain.prefill(backend, book)
    while plain.tokens[-1] != eos and len(plain.output()) < 60:
        plain.step(backend, book, [])
    assert plain.tokens[-1] == eos, "the premise: the plain run completes its document"

    rng = np.random.default_rng(seed)
    spec = Lanes(2, cid, grammar, temperature, seed, _table(3))
    spec.prefill(backend, book)
    accepted = rejected = 0
    masks0 = book.stats.masks
    while eos not in spec.tokens[len(PROMPT):]:
        at = len(spec.output())
        assert spec.output() == plain.output()[:at]
        drafts = _perturbed(rng, plain.output()[at:], int(rng.integers(1, 6)), vocab, eos)
        out = spec.step(backend, book, drafts)
        accepted += int(out.accepted[0])
        rejected += int(out.accepted[0]) < len(drafts)
    n = spec.tokens[len(PROMPT):].index(eos) + 1
    assert spec.output()[:n] == plain.output()
    assert spec.logprobs[:n] == pytest.approx(plain.logprobs, abs=1e-4)

    assert accepted > 0 and rejected > 0 and book.stats.masks > masks0


class _FailingOnce:
    """The backend, but its next prefill fails (a device fault after the job's masks were computed)."""

    def __init__(self, backend):
        self.backend, self.armed = backend, True

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def prefill(self, job):
        if self.armed:
            self.armed = False
            raise RuntimeError("device fault")
        return self.backend.prefill(job)


def test_a_verification_job_that_fails_is_retried_from_the_state_before_it(backend, package):
    """The failed attempt fed the drafts to the matcher for their masks; the retry (the same job) starts
    from the state before them: the same output as a run that never failed."""
    eos = package.eos_ids[0]
    cid, grammar = compiled("json_schema", SCHEMA)
    book = constraint_book(package, backend.describe())
    runs = [Lanes(key, cid, grammar, 0.0, 0, _table(4 + key)) for key in (1, 2)]
    for r in runs:
        r.prefill(backend, book)
        for _ in range(3):
            r.step(backend, book, [])
    plain = Lanes(3, cid, grammar, 0.0, 0, _table(8))
    plain.prefill(backend, book)
    while plain.tokens[-1] != eos and len(plain.output()) < 60:
        plain.step(backend, book, [])
    at = len(runs[0].output())
    drafts = plain.output()[at:at + 2] + [ord("]")]  # two right, then one the schema forbids there
    failing = _FailingOnce(backend)
    c = {"constraint": cid, "constraint_key": 2, "constraint_done": at}
    lane = Lane(runs[1].tokens[-1:] + drafts, len(runs[1].tokens) - 1, runs[1].table, drafts=3, **c)
    out = execute_job(failing, build_job(JobKind.PREFILL, [lane]), constraints=book)
    assert out.status.name == "FAILED" and "device fault" in out.error
    for r in runs:
        assert int(r.step(failing, book, drafts).accepted[0]) == 2
        while r.tokens[-1] != eos and len(r.output()) < 60:
            r.step(backend, book, [])
        assert r.output() == plain.output()


def test_a_draft_models_proposals_on_a_constrained_lane_give_the_plain_output(package):
    """The model drafting for itself (`speculative: "draft"`) proposes its unconstrained greedy tokens; under
    a JSON schema some are accepted, others masked out: the output is the plain constrained run's."""
    eos = package.eos_ids[0]
    target, mirror = RefBackend(), RefBackend(num_blocks=package.kv_num_blocks)
    target.load(package)
    mirror.load(package)
    draft = DraftModel(mirror)
    try:
        cid, grammar = compiled("json_schema", SCHEMA)
        book = constraint_book(package, target.describe())
        plain = Lanes(1, cid, grammar, 0.0, 0, _table(0))
        plain.prefill(target, book)
        while plain.tokens[-1] != eos and len(plain.output()) < 60:
            plain.step(target, book, [])
        drafted = Lanes(2, cid, grammar, 0.0, 0, _table(1))
        lane = Lane(drafted.tokens, 0, drafted.table, constraint=cid, constraint_key=2, constraint_done=0,
                    replay=[], grammar=grammar)
        out = execute_job(target, build_job(JobKind.PREFILL, [lane]), constraints=book, draft=draft)
        drafted.tokens.append(int(out.tokens[0]))
        accepted = rejected = 0
        while eos not in drafted.output():
            out = drafted.step(target, book, [drafted.tokens[-1]] * 4, draft=draft)
            accepted += int(out.accepted[0])
            rejected += int(out.accepted[0]) < 4
        n = drafted.output().index(eos) + 1
        assert drafted.output()[:n] == plain.output()
        assert accepted > 0 and rejected > 0
    finally:
        target.unload()
        mirror.unload()
