"""Worker-side constrained decoding on the tiny `ref` model: masks, replay, retries, neighbours."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from engine.daemon.constraint_cache import ConstraintCache, ConstraintRejected, grammar_of
from ipc.records import Job, JobKind, Lane, build_job
from workers.constraints import LaneMask
from workers.execute_job import execute_job
from workers.lane_sampling import sample_masked
from workers.main import constraint_book
from workers.sampling import sample
from tests.workers.ref_model_fixtures import backend, package  # noqa: F401 - fixtures

PROMPT = [256, *b"Data: "]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False},
    },
    "required": ["name", "size", "inner"],
    "additionalProperties": False,
}



class Run:
    """One request driven the way the scheduler drives it: a prefill lane with the grammar, then decode lanes."""

    def __init__(self, key: int, grammar: str | None, cid: int, temperature: float, seed: int, table: list[int]):
        self.key, self.grammar, self.cid = key, grammar, cid
        self.temperature, self.seed, self.table = temperature, seed, table
        self.tokens = list(PROMPT)
        self.done = False

    def lane(self, prefill: bool) -> Lane:
        out_n = len(self.tokens) - len(PROMPT)
        c = {}
        if self.grammar is not None:
            c = {"constraint": self.cid, "constraint_key": self.key, "constraint_done": out_n}
            if prefill:
                c.update(replay=self.tokens[len(PROMPT):], grammar=self.grammar)
        if prefill:
            return Lane(self.tokens, 0, self.table, temperature=self.temperature, seed=self.seed, **c)
        return Lane(self.tokens[-1:], len(self.tokens) - 1, self.table, temperature=self.temperature,
                    seed=self.seed, **c)


def step(backend, book, runs: list[Run], prefill: bool) -> None:
    if prefill:
        for r in runs:
            out = execute_job(backend, build_job(JobKind.PREFILL, [r.lane(True)]), constraints=book)
            assert not out.error, out.error
            r.tokens.append(int(out.tokens[0]))
        return
    live = [r for r in runs if not r.done]
    job = build_job(JobKind.DECODE, [r.lane(False) for r in live])
    job = Job.from_arrays(job.to_arrays(), copy=False)  # through the wire format, as the worker reads it
    out = execute_job(backend, job, constraints=book)
    assert not out.error, out.error
    for r, t in zip(live, out.tokens.tolist()):
        r.tokens.append(t)


def finish(backend, book, runs: list[Run], eos: int, max_new: int) -> None:
    for r in runs:
        r.done = r.tokens[-1] == eos
    while any(not r.done for r in runs):
        step(backend, book, runs, prefill=False)
        for r in runs:
            r.done = r.done or r.tokens[-1] == eos or len(r.tokens) - len(PROMPT) >= max_new


def output(r: Run, eos: int) -> str:
    out = r.tokens[len(PROMPT):]
    assert eos not in out[:-1]
    return bytes(t for t in out if t < 256).decode("utf-8")


def compiled(kind: str, body) -> tuple[int, str]:
    spec = ConstraintCache().get(kind, body)
    return spec.id, spec.grammar


@pytest.mark.parametrize("temperature,seeds", [(0.0, [0]), (1.0, [1, 2, 3, 4, 5, 6])])
def test_every_completed_json_output_validates(backend, package, temperature, seeds):
    cid, grammar = compiled("json_schema", SCHEMA)
    book = constraint_book(package, backend.describe())
    eos = package.eos_ids[0]
    runs = [Run(i, grammar, cid, temperature, s, [i * 8 + k for k in range(8)]) for i, s in enumerate(seeds)]
    step(backend, book, runs, prefill=True)
    finish(backend, book, runs, eos, max_new=120)
    completed = [r for r in runs if r.tokens[-1] == eos]
    assert len(completed) >= max(1, len(runs) // 2)
    for r in completed:
        jsonschema.validate(json.loads(output(r, eos)), SCHEMA)
    assert book.stats.masks > 0 and book.stats.compiles == 1  # one compile per grammar, deep-copied per request


def test_regex_and_grammar_outputs_match(backend, package):
    eos = package.eos_ids[0]
    book = constraint_book(package, backend.describe())
    date_id, date = compiled("regex", r"\d{4}-\d{2}-\d{2}")
    yes_id, yesno = compiled("gbnf", 'root ::= ("yes" | "no") " " [0-9]')
    lark_id, lark = compiled("lark", 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/')
    runs = [Run(1, date, date_id, 1.0, 7, list(range(8))), Run(2, yesno, yes_id, 1.0, 8, list(range(8, 16))),
            Run(3, lark, lark_id, 0.0, 0, list(range(16, 24)))]
    step(backend, book, runs, prefill=True)
    finish(backend, book, runs, eos, max_new=40)
    assert all(r.tokens[-1] == eos for r in runs)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", output(runs[0], eos))
    assert re.fullmatch(r"(yes|no) [0-9]", output(runs[1], eos))
    assert re.fullmatch(r"<[a-z]{1,5}>", output(runs[2], eos))


def _chars_led_by(byte: int) -> tuple[int, int]:
    """The code points whose UTF-8 encoding starts with `byte` (ASCII: itself; a lead byte: its block)."""
    if byte < 0x80:
        return byte, byte
    for first, last, payload, bits, floor in ((0xC2, 0xDF, 0x1F, 6, 0x80), (0xE0, 0xEF, 0x0F, 12, 0x800),
                                              (0xF0, 0xF4, 0x07, 18, 0x10000)):
        if first <= byte <= last:
            lo = (byte & payload) << bits
            hi = min(lo + (1 << bits) - 1, 0x10FFFF)
            return max(lo, floor), (0xD7FF if lo == 0xD000 else hi)  # no surrogates in a regex class
    raise AssertionError(f"token {byte} starts no character")


def test_a_mostly_allowed_step_masks_the_denied_ids(backend, package):
    """Where the constraint allows most of the vocabulary, the worker hands the mask over as the denied ids
    (LaneMask's deny form): the model's own greedy choice, denied there, is not sampled; the best allowed
    token is."""
    eos, vocab = package.eos_ids[0], backend.describe().vocab_size
    book = constraint_book(package, backend.describe())
    free = Run(1, None, 0, 0.0, 0, list(range(8)))
    step(backend, book, [free], prefill=True)
    top = free.tokens[-1]  # the model's greedy first token, unconstrained
    assert top < 256, "the premise: the model's first choice is a byte a regex can deny"
    lo, hi = _chars_led_by(top)
    cid, grammar = compiled("regex", rf"[^\x{{{lo:x}}}-\x{{{hi:x}}}]{{1,8}}")  # any 1-8 characters but those
    r = Run(2, grammar, cid, 0.0, 0, list(range(8, 16)))
    first = build_job(JobKind.PREFILL, [r.lane(True)])
    mask = LaneMask.of(constraint_book(package, backend.describe()).allowed(first, np.array([0]), vocab)[0])
    assert mask.deny is not None and top in mask.deny  # the dense form, and it denies the model's choice
    logits = backend.prefill(first).logits[0]
    best_allowed = max(set(range(vocab)) - set(mask.deny.tolist()), key=lambda t: logits[t])
    step(backend, book, [r], prefill=True)
    assert r.tokens[len(PROMPT)] == best_allowed != top
    finish(backend, book, [r], eos, max_new=40)
    assert r.tokens[-1] == eos
    assert re.fullmatch(rf"[^{re.escape(chr(lo))}-{re.escape(chr(hi))}]{{1,8}}", output(r, eos))


def test_unconstrained_neighbours_get_the_tokens_they_get_alone(backend, package):
    eos = package.eos_ids[0]
    cid, grammar = compiled("json_object", "")
    alone = [Run(10 + i, None, 0, 1.0, 30 + i, list(range(i * 8, i * 8 + 8))) for i in range(2)]
    book = constraint_book(package, backend.describe())
    step(backend, book, alone, prefill=True)
    finish(backend, book, alone, -1, max_new=30)
    mixed = [Run(10 + i, None, 0, 1.0, 30 + i, list(range(i * 8, i * 8 + 8))) for i in range(2)]
    mixed.insert(1, Run(20, grammar, cid, 1.0, 9, list(range(16, 24))))
    step(backend, book, mixed, prefill=True)
    finish(backend, book, mixed, -1, max_new=30)
    assert [r.tokens for r in alone] == [mixed[0].tokens, mixed[2].tokens]
    assert mixed[1].tokens[len(PROMPT)] == ord("{")


def test_state_rebuilt_from_replay_equals_the_incremental_one_and_retries_feed_once(backend, package):
    """A requeue (new worker, re-prefill with the output so far) and a retried job leave the mask unchanged."""
    eos = package.eos_ids[0]
    cid, grammar = compiled("json_schema", SCHEMA)
    book = constraint_book(package, backend.describe())
    r = Run(1, grammar, cid, 1.0, 3, list(range(8)))
    step(backend, book, [r], prefill=True)
    for _ in range(12):
        step(backend, book, [r], prefill=False)
    assert eos not in r.tokens
    decode = Job.from_arrays(build_job(JobKind.DECODE, [r.lane(False)]).to_arrays())
    ok_incremental = book.allowed(decode, np.array([0]), backend.describe().vocab_size)[0]
    again = book.allowed(decode, np.array([0]), backend.describe().vocab_size)[0]  # the same job retried
    assert (ok_incremental == again).all()
    fresh = constraint_book(package, backend.describe())  # another worker: rebuilt from the replay
    prefill = build_job(JobKind.PREFILL, [Lane(r.tokens, 0, r.table, temperature=1.0, seed=3, constraint=cid,
                                               constraint_key=1, constraint_done=len(r.tokens) - len(PROMPT),
                                               replay=r.tokens[len(PROMPT):], grammar=grammar)])
    # the prefill samples the token after all of r.tokens: the matcher has then seen every output token
    ok_rebuilt = fresh.allowed(prefill, np.array([0]), backend.describe().vocab_size)[0]
    assert (ok_rebuilt == ok_incremental).all() and 0 < ok_rebuilt.sum() < ok_rebuilt.size


def test_a_decode_lane_without_state_fails_the_job_not_the_worker(backend, package):
    cid, grammar = compiled("json_object", "")
    book = constraint_book(package, backend.describe())
    job = build_job(JobKind.DECODE, [Lane([5], 9, [0], constraint=cid, constraint_key=99, constraint_done=3)])
    out = execute_job(backend, job, constraints=book)
    assert out.status.name == "FAILED" and "no constraint state" in out.error


@pytest.mark.parametrize("kind,body,words", [
    ("json_schema", {"type": "objectx"}, "objectx"),
    ("json_schema", "{not json", "not JSON"),
    ("regex", "(\\d", "unclosed group"),
    ("lark", "start: foo", "unknown name"),
    ("gbnf", "root ::= (", "gbnf"),
])
def test_bad_constraints_are_rejected_with_the_reason(kind, body, words):
    with pytest.raises(ConstraintRejected, match=re.escape(words)):
        grammar_of(kind, body)


def test_compact_masks_sample_exactly_what_full_rows_with_minus_inf_sample():
    """The worker samples a few-allowed lane over its allowed ids only, the others over a copy with the denied
    ids at -inf: token for token what the plain definition (every disallowed logit -inf) gives."""
    rng = np.random.default_rng(7)
    b, v = 6, 400
    logits = rng.standard_normal((b, v)).astype(np.float32) * 3
    logits.flags.writeable = False
    for trial in range(200):
        oks = {lane: rng.random(v) < (0.02 if lane % 2 else 0.9) for lane in range(b) if lane != 3}
        for ok in oks.values():
            ok[rng.integers(v)] = True
        job = build_job(JobKind.DECODE, [Lane([1], 5, [0], temperature=float(rng.choice([0.0, 0.7, 1.5])),
                                              top_k=int(rng.choice([0, 1, 5, 50, 1000])), top_p=float(rng.choice([1.0, 0.8])),
                                              seed=int(rng.integers(1 << 62)), want_logprobs=True)
                                         for _ in range(b)])
        lanes = np.arange(b)
        full = np.array([np.where(oks[lane], logits[lane], np.float32(-np.inf)) if lane in oks else logits[lane]
                         for lane in range(b)], np.float32)
        want, _ = sample(full, job.temperature, job.top_p, job.top_k, job.seed, job.context_lens)
        tokens, logprobs = np.full(b, -1, np.int32), np.zeros(b, np.float32)
        sample_masked(job, logits, lanes, tokens, logprobs, {lane: LaneMask.of(ok) for lane, ok in oks.items()})
        assert tokens.tolist() == want.tolist(), trial
        assert all(oks[lane][tokens[lane]] for lane in oks)
        _, raw = sample(logits, job.temperature, job.top_p, job.top_k, job.seed, job.context_lens)
        assert logprobs[3] == raw[3]  # the unconstrained lane's, and the others' are the model's own too
