"""What a request streams: sampled tokens accepted one by one, stop conditions, detokenised text.

`Output.accept` is the hot path: it runs once per lane of every job (a plain
decode lane's run is one token) and its loop once per generated token, so it
keeps to locals, allocates nothing of its own per token and reaches the
state object once per call.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.actions import Action, EmitTokens, FinishRequest
from engine.core.chip_state import ChipState
from engine.core.logprob_asks import split
from engine.core.request_record import RequestRecord
from engine.core.requests import RequestState
from engine.core.sched.admission import Admission
from engine.core.sched.lifecycle import Lifecycle
from engine.core.sched.state import SchedState
from engine.core.stop_conditions import StopReason
from engine.core.text_stream import TextStream

S = RequestState


class Output:
    def __init__(self, st: SchedState, admission: Admission, lifecycle: Lifecycle) -> None:
        self.st = st
        self.vocab = st.model.vocab_size
        self.admission = admission
        self.lifecycle = lifecycle

    def accept(self, r: RequestRecord, ch: ChipState, toks: Sequence[int], lps: Sequence[float], i: int, hi: int,
               now: float, out: list[Action]) -> int:
        """Feed r the run of sampled tokens toks[i:hi] (logprob lps[k], 0.0 where lps is shorter): a decode
        lane's one token, a multi-step job's row, or an accepted draft run and the token after it. The request
        stays running until the run's last token, then is ready for its next step (or its queued step carries it).

        Returns the index of the token at which a stop condition ended the request (nothing after it is
        streamed); `hi` when none did (every token taken, or a token out of the vocabulary failed the request).
        """
        st = self.st
        vocab = self.vocab
        n_lps = len(lps)
        while i < hi:
            token = toks[i]
            if not 0 <= token < vocab:
                self.lifecycle.fail_bad_token(r, ch, f"the chip returned token {token}", now, out)
                return hi
            r.tokens.append(token)
            r.generated += 1
            st.generation_tokens += 1
            if r.generated == 1:  # the prompt counts once, when its first token is sampled (as vLLM counts it)
                st.prompt_tokens += len(r.params.prompt)
            emit, emit_lps, stop = r.stop.feed(token, lps[i] if i < n_lps else 0.0)
            text = None
            ts = r.text
            if ts is not None:
                if ts.plain and stop is None and len(emit) == 1:  # the common case, without a TextStep
                    text = ts.decode(st.piece(emit[0]))
                else:
                    emit, text, stop = self._detokenize(ts, emit, stop)
            if emit or text:
                if r.t_first_token is None:
                    r.t_first_token = now
                elif st.tpot_watch and ch.governor.on_interval(now - r.t_last_token):
                    st.note_downgraded(ch)
                r.t_last_token = now
                r.emitted += len(emit)
                if r.params.top_logprobs:  # the entries are TokenLogprob: their alternatives go beside
                    lps_out, tops = split(emit_lps[:len(emit)])
                    out.append(EmitTokens(r.request_id, emit, lps_out, text, tops))
                else:
                    out.append(EmitTokens(r.request_id, emit, emit_lps[:len(emit)] if r.params.logprobs else None,
                                          text))
            if stop is not None:
                self._finish(r, stop, now, out)
                return i
            i += 1
        if r.job_id is not None:  # its queued next step already carries it (still DECODE_RUNNING)
            ch.may_queue_step(r)
        else:
            r.move(S.DECODE_READY)
            r.ready_since = now
            ch.decode_ready[r.request_id] = None
        return hi

    def _finish(self, r: RequestRecord, stop: StopReason, now: float, out: list[Action]) -> None:
        if r.t_first_token is None:
            r.t_first_token = r.t_last_token = now
        reason = stop.value
        self.st.counters[f"finished_{reason}"] += 1
        if r.job_id is None:
            self.admission.unbind(r, released=True)
        else:  # its queued next step is past the end: it drains, then the lane is released
            self.st.counters["queued_steps_past_end"] += 1
        r.move(S.FINISHING)
        out.append(FinishRequest(r.request_id, reason, r.usage(), r.timing(now)))
        r.terminal_emitted = True
        r.move(S.COMPLETED)
        self.lifecycle.forget_if_done(r)

    finish = _finish  # a request ended outside accept (max_tokens 0 with prompt logprobs)

    def _detokenize(self, ts: TextStream, emit: list[int], stop: StopReason | None
                    ) -> tuple[list[int], str, StopReason | None]:
        """Feed the released tokens' bytes to the text stream: (tokens to emit, text delta, stop reason).

        A stop string ends the request at the token that completes it; that
        token and the ones before it are emitted (ids are the raw output), the
        text ends before the stop string. When generation ends for another
        reason the held text is flushed.
        """
        piece = self.st.piece
        parts: list[str] = []
        for i, tok in enumerate(emit):
            step = ts.feed(piece(tok))
            if step.text:
                parts.append(step.text)
            if step.stopped:
                return emit[:i + 1], "".join(parts), StopReason.STOP
        if stop is not None:
            step = ts.finish()
            if step.text:
                parts.append(step.text)
            if step.stopped:
                stop = StopReason.STOP
        return emit, "".join(parts), stop
