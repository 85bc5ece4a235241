"""The documented shapes of events, as assertions (protocol.md "Server events" and "Errors").

Each function raises `Fail` with what was expected and what came; events
are read leniently, so only the documented fields are checked and unknown
ones are allowed.
"""

from __future__ import annotations

import re

FINISH_REASONS = ("length", "eos", "stop", "cancelled")
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")
TIMING_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")


class Fail(AssertionError):
    """The endpoint broke a promise of the document."""


class Skip(Exception):
    """The check cannot run against this endpoint (the reason says what set-up it needs)."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Fail(what)


def short(obj, n: int = 300) -> str:
    s = repr(obj)
    return s if len(s) <= n else s[:n] + "..."


def has_keys(obj: dict, keys, where: str) -> None:
    expect(isinstance(obj, dict), f"{where} is not an object: {short(obj)}")
    missing = [k for k in keys if k not in obj]
    expect(not missing, f"{where} lacks the documented key(s) {missing}: has {sorted(obj)}")


def is_int(x) -> bool:
    return type(x) is int


def is_num_or_null(x) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def error_event(ev: dict, code: int | None = None, reason: str | None = None, rid=...) -> dict:
    """An `error` event with the documented fields (and the code/reason/id wanted, when given)."""
    expect(ev.get("ev") == "error", f"expected an error event{f' {code} {reason}' if code else ''}, got {short(ev)}")
    expect(is_int(ev.get("code")), f"error.code is not an int: {short(ev)}")
    expect(isinstance(ev.get("reason"), str) and bool(SNAKE.match(ev["reason"])),
           f"error.reason is not snake_case: {short(ev)}")
    expect(isinstance(ev.get("message"), str) and ev["message"] != "", f"error.message is empty: {short(ev)}")
    expect(type(ev.get("retryable")) is bool, f"error.retryable is not a bool: {short(ev)}")
    if ev["retryable"] and ev["code"] in (429, 503):  # says when to come back, clamped to 100 ms .. 60 s
        ra = ev.get("retry_after_ms")
        expect(is_int(ra) and 100 <= ra <= 60000,
               f"a retryable {ev['code']} needs retry_after_ms, an int in [100, 60000]: {short(ev)}")
    if not ev["retryable"]:
        expect("retry_after_ms" not in ev, f"a non-retryable error carries retry_after_ms: {short(ev)}")
    if code is not None:
        expect(ev["code"] == code, f"expected code {code}, got {ev['code']} ({ev['reason']}: {ev['message']})")
    if reason is not None:
        expect(ev["reason"] == reason, f"expected reason {reason!r}, got {ev['reason']!r} ({ev['message']})")
    if rid is not ...:
        expect(ev.get("id") == rid, f"expected id {rid!r} in the error, got {ev.get('id')!r}")
    return ev


def generate_result(events: list[dict], *, stream: bool, text: bool, prompt_len: int | None = None,
                    logprobs: bool = False, daemon: bool = False) -> dict:
    """Check one generate's events and return {tokens, text, done, logprobs}.

    One terminal event, last; before it only `tokens` events (none with
    `stream: false`); `usage.completion_tokens` equals the tokens received.
    """
    expect(bool(events), "no event at all")
    terminals = [e for e in events if e["ev"] in ("done", "error")]
    expect(len(terminals) == 1, f"expected exactly one terminal event, got {[e['ev'] for e in events]}")
    expect(events[-1] is terminals[0], f"events after the terminal event: {[e['ev'] for e in events]}")
    last = events[-1]
    if last["ev"] == "error":
        error_event(last)
        raise Fail(f"the request failed: {last['code']} {last['reason']}: {last['message']}")
    others = [e["ev"] for e in events[:-1] if e["ev"] != "tokens"]
    expect(not others, f"events other than tokens before done: {others}")
    toks: list[int] = []
    lps: list = []
    txt = ""
    streamed = events[:-1]
    if not stream:
        expect(not streamed, f"stream: false got {len(streamed)} tokens event(s)")
    for i, e in enumerate(streamed):
        expect(isinstance(e.get("tokens"), list) and all(is_int(t) for t in e["tokens"]),
               f"tokens event without a list of ids: {short(e)}")
        expect(bool(e["tokens"]) or i == len(streamed) - 1,
               f"an empty tokens list that is not the last tokens event: {short(e)}")
        if text:
            expect(isinstance(e.get("text"), str), f"the model has a tokenizer but a tokens event has no text: "
                                                   f"{short(e)}")
            txt += e["text"]
        else:
            expect("text" not in e, f"the model has no tokenizer but a tokens event carries text: {short(e)}")
        if logprobs:
            expect(isinstance(e.get("logprobs"), list) and len(e["logprobs"]) == len(e["tokens"]),
                   f"logprobs requested: a tokens event needs one per token: {short(e)}")
            lps += e["logprobs"]
        else:
            expect("logprobs" not in e, f"logprobs not requested but sent: {short(e)}")
        toks += e["tokens"]
    done_event(last)
    if stream:
        expect("text" not in last, f"done carries text with stream: true (only stream: false does): {short(last)}")
    else:
        expect(isinstance(last.get("tokens"), list) and all(is_int(t) for t in last["tokens"]),
               f"stream: false: done does not carry the tokens: {short(last)}")
        toks = list(last["tokens"])
        if text:
            expect(isinstance(last.get("text"), str), f"stream: false with a tokenizer: done lacks text: {short(last)}")
            txt = last["text"]
        if logprobs:
            expect(isinstance(last.get("logprobs"), list) and len(last["logprobs"]) == len(toks),
                   f"stream: false with logprobs: done needs one per token: {short(last)}")
            lps = last["logprobs"]
    usage = last["usage"]
    extra = usage["completion_tokens"] - len(toks)
    reason = last["finish_reason"]
    if reason == "eos":  # the EOS id is generated and counted, never sent
        expect(extra == 1, f"usage.completion_tokens is {usage['completion_tokens']} but {len(toks)} token(s) were "
                           "received (finish eos: the EOS id is counted, not sent, so it must be one more)")
    elif reason in ("stop", "cancelled"):
        # a stop token id or a matched token-id stop sequence (<= 64 ids) is counted, not sent; a stop string's
        # ids are sent; a cancel drops ids held back by a partly matched stop sequence
        expect(0 <= extra <= 64, f"usage.completion_tokens is {usage['completion_tokens']} but {len(toks)} "
                                 f"token(s) were received (finish {reason}: at most the 64 ids of a stop "
                                 "sequence may be counted without being sent)")
    else:
        expect(extra == 0, f"usage.completion_tokens is {usage['completion_tokens']} but {len(toks)} token(s) "
                           f"were received (finish {reason})")
    if prompt_len is not None:
        expect(usage["prompt_tokens"] == prompt_len,
               f"usage.prompt_tokens is {usage['prompt_tokens']}, the prompt had {prompt_len} tokens")
    if daemon:
        expect("generation" in last, f"a board daemon's done must carry the generation: {short(last)}")
    return {"tokens": toks, "text": txt, "done": last, "logprobs": lps}


def done_event(ev: dict) -> None:
    expect(ev.get("finish_reason") in FINISH_REASONS, f"done.finish_reason not one of {FINISH_REASONS}: {short(ev)}")
    has_keys(ev.get("usage"), USAGE_KEYS, "done.usage")
    expect(all(is_int(ev["usage"][k]) for k in USAGE_KEYS), f"done.usage values must be ints: {ev['usage']}")
    has_keys(ev.get("timing"), TIMING_KEYS, "done.timing")
    expect(all(is_num_or_null(ev["timing"][k]) for k in TIMING_KEYS),
           f"done.timing values must be numbers or null: {ev['timing']}")
