"""The list of checks, in the order they run, each named after the promise of protocol.md it holds the endpoint to.

`needs` names the option a check cannot run without (it is then reported
as skipped, with what to pass); the drain check runs last but one so that a
failure to resume cannot spoil the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tools.conformance import checks_errors as E
from tools.conformance import checks_generate as G
from tools.conformance import checks_lifetime as L
from tools.conformance import checks_ops as O


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable
    what: str  # one line: the promise checked
    needs: str | None = None  # "admin", "admin_denied", "overload", "second_model", "package"


CHECKS: tuple[Check, ...] = (
    Check("health_reply", O.check_health, "health answers one health event with the documented keys"),
    Check("stats_reply", O.check_stats, "stats answers one stats event with the documented keys"),
    Check("models_reply", O.check_models, "models lists every generation with the ENTRY keys"),
    Check("generate_stream", G.check_generate_stream, "tokens events then one done; usage counts what was sent"),
    Check("generate_no_stream", G.check_generate_no_stream, "stream: false: no tokens events, done carries tokens"),
    Check("logprobs", G.check_logprobs, "logprobs: one number per token, streamed and in done"),
    Check("text_prompt", G.check_text_prompt, "text prompts (or 400 no_tokenizer without a tokenizer)"),
    Check("stop_token_ids", G.check_stop_token_ids, "a stop token id ends with stop, the id not emitted"),
    Check("stop_sequences", G.check_stop_sequences, "stop id sequences (not emitted) and stop strings (text cut)"),
    Check("continuation", G.check_continuation, "continuation counts toward max_tokens and resumes a seeded stream"),
    Check("structured_output", G.check_structured_output, "constraints: invalid_constraint, regex-conforming text"),
    Check("every_field", G.check_every_field, "every client field of generate accepted at a valid value"),
    Check("seeded_crowd", G.check_seeded_crowd, "seeded sampling alone equals the same request in a crowd"),
    Check("one_event_per_message", G.check_single_frame_messages,
          "without hello, every message is one frame holding one event"),
    Check("hello", O.check_hello, "hello grants known capabilities; batched frames are each an event"),
    Check("cancel", L.check_cancel, "cancel twice and of an unknown id: no reply; ends done/cancelled"),
    Check("cancel_finished", L.check_cancel_finished, "cancel of a finished request: no reply"),
    Check("ids_per_connection", L.check_ids_per_connection, "the same id on two connections is two requests"),
    Check("error_504_deadline", L.check_deadline, "a missed deadline_ms ends with error 504"),
    Check("error_404_model_not_found", L.check_model_not_found, "an alias not served: 404 model_not_found"),
    *(Check(f"error_400_{r}", E.make_reason_check(r), f"malformed ({r}): 400 {r}, not retryable, keeps serving")
      for r in E.REASONS),
    Check("error_400_per_model", E.check_per_model, "a token id outside the vocabulary, a context too long: 400"),
    Check("error_400_too_large", E.check_too_large, "over server.max_message_bytes: 400 too_large with its id"),
    Check("error_400_duplicate_id", L.check_duplicate_id, "an id in flight again: 400 duplicate_id, first continues"),
    Check("second_model", L.check_second_model, "a second alias is listed and served", needs="second_model"),
    Check("error_429_overloaded", L.check_overload, "a burst over the waiting room: retryable 429", needs="overload"),
    Check("error_403_forbidden", O.check_forbidden, "admin ops without admin rights: 403 forbidden",
          needs="admin_denied"),
    Check("model_lifecycle", O.check_model_lifecycle, "load/unload replies, the lifecycle errors, a second alias",
          needs="package"),
    Check("drain_resume", O.check_drain_resume, "drain (503 draining), resume, each answered by its event",
          needs="admin"),
)


def by_name(name: str) -> Check:
    for c in CHECKS:
        if c.name == name:
            return c
    raise KeyError(name)
