"""The scheduler's per-request record: lifecycle state, tokens, KV binding, timing."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.requests import LEGAL_MOVES, TERMINAL_STATES, GenerateParams, RequestState, check_transition
from engine.core.stop_conditions import StopChecker
from engine.core.text_stream import TextStream


@dataclass(eq=False)
class RequestRecord:
    request_id: int
    params: GenerateParams
    arrival: float
    deadline: float | None
    stop: StopChecker
    # prompt + continuation + every token sampled here; the KV of tokens[:committed] is on the chip
    tokens: list[int]
    state: RequestState = RequestState.NEW
    generated: int = 0  # tokens sampled by this scheduler
    emitted: int = 0  # tokens handed to the client by this scheduler
    chip: int | None = None
    seq_id: int | None = None
    committed: int = 0  # mirror of the KV sequence's committed_len
    reserved: int = 0  # mirror of the KV sequence's reserved_len
    prefill_target: int = 0  # tokens whose KV must exist before decoding
    cached_tokens: int = 0  # prefix-cache hit at first admission
    job_id: int | None = None  # job in flight that carries this request
    next_job: int | None = None  # its queued next step (executor.queue_next_step), carrying it after job_id
    retries: int = 0
    # decode candidate order (deadline, turn), sorted on every decode job: the turn is drawn at admission and
    # again each time the lane gets a step (BatchPlanner.decode_candidates)
    decode_key: tuple[float, int] = (0.0, 0)
    admit_order: int = 0  # larger = admitted later: the preemption victim order
    ready_since: float = 0.0
    t_first_sched: float | None = None
    t_first_token: float | None = None
    t_last_token: float | None = None
    terminal_emitted: bool = False
    text: TextStream | None = None  # output text and stop strings (None: no tokenizer)
    spec: object | None = None  # engine.core.spec.planner.SpecLane once the request speculates
    # (temperature, top_p, top_k, seed, logprobs) of params: a decode lane's sampling (ipc.records.decode_job)
    sampling: tuple = (0.0, 1.0, 0, 0, False)
    prompt_logprobs_sent: bool = False  # the prompt's logprobs went out (engine.core.logprob_asks)

    @property
    def tenant(self) -> str:
        return self.params.tenant

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def move(self, new: RequestState) -> None:
        if new not in LEGAL_MOVES[self.state]:  # == check_transition, inlined: twice per generated token
            check_transition(self.state, new)
        self.state = new

    def usage(self) -> dict:
        return {
            "prompt_tokens": len(self.params.prompt),
            "completion_tokens": self.generated,
            "cached_tokens": self.cached_tokens,
        }

    def timing(self, now: float) -> dict:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000.0, 3)

        tpot = None
        if self.t_first_token is not None and self.t_last_token is not None and self.emitted > 1:
            tpot = round((self.t_last_token - self.t_first_token) * 1000.0 / (self.emitted - 1), 3)
        return {
            "ttft_ms": ms(self.arrival, self.t_first_token),
            "tpot_ms": tpot,
            "e2e_ms": ms(self.arrival, now),
            "queue_ms": ms(self.arrival, self.t_first_sched if self.t_first_sched is not None else now),
        }
