"""Constrained decoding in the worker: the token mask of each constrained lane, from llguidance.

A job names each constrained lane's grammar by id (its hash) and its request
by key (`ipc.records`). The worker keeps one llguidance matcher per request,
between jobs, in `ConstraintBook`:

* a lane that carries its grammar (the sampling prefill of a request: first
  admission, a requeue after a chip fault, a balancer resuming elsewhere)
  (re)builds the matcher from the grammar and replays the output tokens so
  far: the state is a pure function of (grammar, tokens), the same on any chip;
* a decode lane feeds its input token (the token sampled last step) to the
  matcher, once: a retried job feeds nothing twice (`consumed` counts);
* a lane with speculative drafts is then stepped through its drafts to mask
  each draft position, and set back to its accepted run once the drafts are
  verified (`draft_masks`, `settle`, `workers.masked_verify`; `drafted` counts
  the drafts fed meanwhile).

The mask is computed just before sampling, on the logits of this step, and
applied before temperature/top-k/top-p (disallowed tokens get -inf); EOS is
allowed only where the grammar is complete (llguidance's rule). A matcher in
an error state (a replayed token the grammar refuses) allows only EOS: the
request ends instead of producing text outside the constraint.

The llguidance tokenizer is built once per worker from the package's own
vocabulary (`workers.tokenizer.load_tokenizer`): byte-level pieces for the
tiny models, llama.cpp's pieces for GGUF packages (special tokens marked
with llguidance's 0xFF prefix so grammars never match them as text).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

_MAX_STATES = 4096  # requests whose matcher a worker keeps (live lanes of a chip are far fewer)
_MAX_GRAMMARS = 256  # compiled grammars kept (deep-copied per request: compiling once per grammar)


class ConstraintError(RuntimeError):
    """A constrained lane the worker cannot serve (no state, no logits): fails the job, never the worker."""


@dataclass
class LaneState:
    constraint_id: int
    matcher: object  # llguidance.LLMatcher
    consumed: int  # output tokens fed to the matcher
    drafted: int = 0  # draft tokens fed past them, pending their verification (`settle`)


@dataclass
class ConstraintStats:
    """Counters for the worker's stats: compile and mask cost, in microseconds."""

    compiles: int = 0
    compile_us: int = 0
    masks: int = 0
    mask_us: int = 0
    rebuilds: int = 0
    errors: int = 0

    def to_dict(self) -> dict:
        return {"compiles": self.compiles, "compile_us": self.compile_us, "masks": self.masks,
                "mask_us": self.mask_us, "rebuilds": self.rebuilds, "errors": self.errors}


class _VocabWrapper:
    """What llguidance.TokenizerWrapper reads: token byte strings, EOS/BOS ids, and a bytes -> ids encoder."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, special: list[int], encode):
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = special
        self._encode = encode

    def __call__(self, data: bytes) -> list[int]:
        return self._encode(data)


def lltokenizer_for(tokenizer, vocab_size: int, eos_ids) -> object:
    """An llguidance.LLTokenizer over a package tokenizer (`workers.tokenizer.Tokenizer`).

    Token bytes come from the tokenizer's own pieces; a token with no text
    piece (BOS, EOS, control tokens, ids >= 256 of the byte vocabulary) is
    special, spelled b"\\xff<name>" as llguidance expects.
    """
    import llguidance

    tokens: list[bytes] = []
    special: list[int] = []
    special_text = getattr(tokenizer, "special_piece", None)
    for i in range(vocab_size):
        p = tokenizer.piece(i) if i < tokenizer.vocab_size else b""
        if p:
            tokens.append(p)
            continue
        name = special_text(i) if special_text is not None and i < tokenizer.vocab_size else b""
        tokens.append(b"\xff" + (name or b"<special_%d>" % i))
        special.append(i)
    raw_encode = getattr(tokenizer, "encode_bytes", None)
    encode = raw_encode if raw_encode is not None else (lambda data: list(data))
    eos = [int(e) for e in eos_ids]
    wrapper = _VocabWrapper(tokens, eos[0], getattr(tokenizer, "bos_id", None), special, encode)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=eos)


class ConstraintBook:
    """The matchers of one worker: compiled grammars by id, lane states by request key.

    `start` computes a job's masks on a helper thread while the backend runs
    the job (a mask depends only on tokens already sampled, and the runtimes
    release the GIL in their calls), so the chip's step hides their cost.
    """

    def __init__(self, make_tokenizer, vocab_size: int | None = None):
        self._make_tokenizer = make_tokenizer  # called once, on the first constrained lane
        self.vocab_size = vocab_size  # the logits' width (start's masks); None: only `allowed`
        self._pool = None
        self._tok = None
        self._grammars: OrderedDict[int, object] = OrderedDict()
        self._states: OrderedDict[int, LaneState] = OrderedDict()
        self.stats = ConstraintStats()

    @property
    def tokenizer(self):
        if self._tok is None:
            self._tok = self._make_tokenizer()
        return self._tok

    def _compiled(self, cid: int, grammar: str):
        m = self._grammars.get(cid)
        if m is not None:
            self._grammars.move_to_end(cid)
            return m
        import llguidance

        t0 = time.perf_counter_ns()
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        self.stats.compiles += 1
        self.stats.compile_us += (time.perf_counter_ns() - t0) // 1000
        if m.is_error():
            raise ConstraintError(f"constraint {cid:#x} does not compile: {m.get_error()}")
        self._grammars[cid] = m
        while len(self._grammars) > _MAX_GRAMMARS:
            self._grammars.popitem(last=False)
        return m

    def _state(self, job, lane: int) -> LaneState:
        cid = int(job.constraint_id[lane])
        key = int(job.constraint_key[lane])
        done = int(job.constraint_done[lane])
        grammar = job.lane_grammar(lane)
        if grammar:  # (re)build from the grammar and the output so far
            m = self._compiled(cid, grammar).deep_copy()
            replay = job.lane_replay(lane)
            if len(replay) != done:
                raise ConstraintError(f"lane {lane}: {len(replay)} replay tokens for {done} output tokens")
            if len(replay):
                m.consume_tokens([int(t) for t in replay])
            st = LaneState(cid, m, done)
            self._states[key] = st
            self._states.move_to_end(key)
            self.stats.rebuilds += 1
            while len(self._states) > _MAX_STATES:
                self._states.popitem(last=False)
            return st
        st = self._states.get(key)
        if st is None or st.constraint_id != cid:
            raise ConstraintError(f"lane {lane}: no constraint state for request key {key} (its prefill ran "
                                  f"on another worker)")
        self._states.move_to_end(key)
        if st.drafted:  # drafts of a job that failed before their verification
            st.matcher.rollback(st.drafted)
            st.drafted = 0
        if st.consumed == done - 1:
            d = int(job.draft_lens[lane]) if job.draft_lens.size else 0
            st.matcher.consume_token(int(job.lane_tokens(lane)[-1 - d]))  # the input token, before any drafts
            st.consumed = done
        elif st.consumed != done:
            raise ConstraintError(f"lane {lane}: matcher fed {st.consumed} tokens, the job says {done}")
        return st

    def allowed(self, job, lanes: np.ndarray, vocab: int) -> dict[int, np.ndarray]:
        """{lane: bool [vocab] of allowed tokens} for the constrained lanes among `lanes` (indices into the job)."""
        out: dict[int, np.ndarray] = {}
        if not job.constrained:
            return out
        ids = job.constraint_id
        for lane in lanes.tolist():
            if not ids[lane]:
                continue
            out[lane] = self.mask_of(self._state(job, lane).matcher, vocab)
        return out

    def mask_of(self, m, vocab: int) -> np.ndarray:
        """bool [vocab]: the tokens matcher `m` allows next (only EOS for a matcher in error or exhausted)."""
        t0 = time.perf_counter_ns()
        ok = np.zeros(vocab, bool)
        if m.is_error():
            self.stats.errors += 1
            ok[self.tokenizer.eos_token] = True
        else:
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
            n = min(vocab, bits.shape[0])
            ok[:n] = bits[:n]
            if not ok.any():  # an exhausted grammar: end the request
                ok[self.tokenizer.eos_token] = True
        self.stats.masks += 1
        self.stats.mask_us += (time.perf_counter_ns() - t0) // 1000
        return ok

    def masks(self, job, lanes: np.ndarray, vocab: int) -> dict[int, LaneMask]:
        """`allowed` in the compact form sampling uses ({lane: LaneMask})."""
        return {lane: LaneMask.of(ok) for lane, ok in self.allowed(job, lanes, vocab).items()}

    def draft_masks(self, job, lanes: np.ndarray, vocab: int) -> dict[int, DraftMasks]:
        """{lane: DraftMasks} for constrained `lanes` that carry drafts: the mask of each draft position.

        The mask of draft row j is the matcher's after the lane's input token
        and drafts 1..j. The matcher is stepped through the drafts while the
        grammar allows them; the first draft it forbids ends the rows there
        (that draft is rejected at its row whatever the model says, and no
        later row can matter). The drafts stay fed (`LaneState.drafted`)
        until `settle` keeps the accepted ones.
        """
        out: dict[int, DraftMasks] = {}
        for lane in lanes.tolist():
            st = self._state(job, lane)
            d = int(job.draft_lens[lane])
            m = st.matcher
            rows = [self.mask_of(m, vocab)]
            for t in job.lane_tokens(lane)[-d:].tolist():
                if not 0 <= t < vocab or m.is_error() or m.is_stopped() or not rows[-1][t] or not m.consume_token(t):
                    break
                st.drafted += 1
                rows.append(self.mask_of(m, vocab))
            out[lane] = DraftMasks(st, [LaneMask.of(ok) for ok in rows])
        return out

    def step_masks(self, job, lanes: np.ndarray, vocab: int, draft_lanes: np.ndarray | None = None
                   ) -> tuple[dict[int, LaneMask], dict[int, DraftMasks]]:
        """(`masks` of `lanes`, `draft_masks` of `draft_lanes`): what one job samples under."""
        drafted = self.draft_masks(job, draft_lanes, vocab) if draft_lanes is not None and draft_lanes.size else {}
        return self.masks(job, lanes, vocab), drafted

    def start(self, job, lanes: np.ndarray, draft_lanes: np.ndarray | None = None):
        """A future of `step_masks(job, lanes, vocab_size, draft_lanes)`, computed beside the backend call;
        None when the job has no constrained lane among them."""
        has_drafts = draft_lanes is not None and draft_lanes.size > 0
        if not job.constrained or self.vocab_size is None or not (job.constraint_id[lanes].any() or has_drafts):
            return None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-masks")
        return self._pool.submit(self.step_masks, job, lanes, self.vocab_size, draft_lanes)

    @staticmethod
    def settle(dm: DraftMasks, accepted: int) -> None:
        """The lane's matcher where its accepted run leaves it: the rejected drafts fed for masking rolled
        back, the accepted ones counted as output."""
        st = dm.state
        if not 0 <= accepted <= st.drafted:
            raise ConstraintError(f"{accepted} drafts accepted, {st.drafted} allowed by the grammar")
        if st.drafted > accepted:
            st.matcher.rollback(st.drafted - accepted)
        st.consumed += accepted
        st.drafted = 0


@dataclass(frozen=True)
class LaneMask:
    """A lane's allowed tokens in the smaller of two forms, made on the helper thread so that the step's
    critical path touches only what it must: the allowed ids when they are few (JSON punctuation, an enum),
    else the denied ones (inside a string, most tokens are allowed)."""

    vocab: int
    allow: np.ndarray | None  # ascending token ids, or None
    deny: np.ndarray | None  # ascending token ids (when `allow` is None)

    @classmethod
    def of(cls, ok: np.ndarray) -> "LaneMask":
        ids = np.flatnonzero(ok)
        if 2 * ids.shape[0] <= ok.shape[0]:
            return cls(ok.shape[0], ids, None)
        return cls(ok.shape[0], None, np.flatnonzero(~ok))


@dataclass
class DraftMasks:
    """The masks of a constrained lane's draft rows, in order: rows[j] for the row that predicts draft j+1
    (the matcher after the input token and drafts 1..j). len(rows) - 1 drafts passed the grammar; with all
    d of them, rows[d] is the mask of the lane's last row (the token after the drafts)."""

    state: LaneState
    rows: list[LaneMask]
