"""OpenAI request bodies -> our generate parameters (pure: no I/O, no clock).

Every rejection is an `OpenAIError` (400 naming the field). Unknown body
fields are rejected, as OpenAI itself does ("Unrecognized request argument"),
so a typo never silently falls back to a default. Fields that exist in
OpenAI's or vLLM's API but ask for something npuserve does not do are
accepted only with their neutral value (e.g. `echo: false`, `n: 1`), and
refused with a 400 that says so otherwise. See docs/http.md for the table.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.http import kv_transfer
from engine.http.openai_error import bad
from engine.http.choices import MAX_CHOICES
from engine.http.response_format import FIELDS as CONSTRAINT_FIELDS, constraint_of
from engine.http.sampling_penalties import FIELDS as PENALTY_FIELDS, penalty_fields
from ipc.schema import NAME_RE, SPECULATIVE_METHODS

MAX_PROMPTS = 128  # prompts in one /v1/completions body (one choice each)
MAX_STOPS = 16  # the wire protocol's limit on `stop` entries
MAX_STOP_CHARS = 256
MAX_TOKENS = 1 << 20
MAX_MESSAGES = 4096
_NOT_TENANT_CHARS = re.compile(r"[^A-Za-z0-9_.:-]")
_MISSING = object()
MAX_TOP_LOGPROBS = 20  # alternatives per token: OpenAI's chat cap, vLLM's for completions


@dataclass
class GenerateRequest:
    """One validated /v1/completions or /v1/chat/completions body."""

    kind: str  # "completion" | "chat"
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: bool  # the chosen tokens' log-probabilities
    user: str | None
    sampling: dict  # wire fields of `generate`: max_tokens (None = chat default), temperature, ...
    prompts: list = field(default_factory=list)  # completion: str or list[int] per choice
    messages: list = field(default_factory=list)  # chat: validated messages
    add_generation_prompt: bool = True
    template_kwargs: dict = field(default_factory=dict)  # chat: extra variables for the template
    handoff: dict | None = None  # vLLM's kv_transfer_params as the wire's hand-off (engine/http/kv_transfer.py)
    top_logprobs: int = 0  # alternatives per token (completions: logprobs = N; chat: top_logprobs)
    echo: bool = False  # completions: the prompt before the completion (its logprobs too, with logprobs)
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's logprobs with this many alternatives
    n: int = 1  # choices returned per prompt (engine/http/choices.py)
    best_of: int | None = None  # completions: choices generated per prompt, the n best returned


# -- field checks ------------------------------------------------------------------------------------
def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if type(v) is not int:
        raise bad(name, f"must be an integer, got {v!r}", "invalid_type")
    if not lo <= v <= hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _num(name: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise bad(name, f"must be a number, got {v!r}", "invalid_type")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise bad(name, f"must be true or false, got {v!r}", "invalid_type")
    return v


def _token_ids(name: str, v: Any) -> list[int]:
    if type(v) is not list or not v:
        raise bad(name, "must be a non-empty list of token ids", "invalid_type")
    if not all(type(t) is int and 0 <= t < 2**31 for t in v):
        raise bad(name, "token ids must be integers in [0, 2^31-1]")
    return v


def parse_prompts(v: Any) -> list:
    """`prompt`: a text, a list of texts, token ids, or a list of token-id lists; one choice per prompt."""
    if type(v) is str:
        return [v]
    if type(v) is not list or not v:
        raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists",
                  "invalid_type")
    if all(type(p) is str for p in v):
        prompts = list(v)
    elif all(type(p) is int for p in v):
        prompts = [_token_ids("prompt", v)]
    elif all(type(p) is list for p in v):
        prompts = [_token_ids(f"prompt[{i}]", p) for i, p in enumerate(v)]
    else:
        raise bad("prompt", "mixes texts, token ids and lists; send one kind", "invalid_type")
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
    return prompts


def parse_stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if type(v) is str else v
    if type(stops) is not list or not all(type(s) is str for s in stops):
        raise bad("stop", "must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    for s in stops:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise bad("stop", f"each stop string must be 1-{MAX_STOP_CHARS} characters, got {s!r}")
    return list(stops)


def tenant_of_user(user: str | None) -> str:
    """The fair-queue tenant of an open front's request: its `user`, made a valid name, else "default"."""
    if not user:
        return "default"
    if NAME_RE.match(user):
        return user
    name = _NOT_TENANT_CHARS.sub("_", user)[:64]
    return name if NAME_RE.match(name) else "_" + name[:63]


# Fields accepted only with a neutral value: name -> (is it neutral?, what is not built).
def _falsy(v: Any) -> bool:
    return v is None or v is False


_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    "no_stop_trim": (_falsy, "no_stop_trim is not supported (stop strings are always cut from the text)"),
    "skip_special_tokens": (lambda v: v is None or v is True, "special tokens are never part of the text; "
                                                             "skip_special_tokens = false is not supported"),
    "return_hidden_states": (_falsy, "hidden states are not returned"),
    "continue_final_message": (_falsy, "continue_final_message is not supported"),
    "tools": (lambda v: v is None or v == [], "tool calling is not supported"),
    "functions": (lambda v: v is None or v == [], "function calling is not supported"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling is not supported"),
    "store": (_falsy, "stored completions are not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
}
# Accepted and without effect here (documented): no reasoning parser, no tool calls to run in parallel, ...
_IGNORED = frozenset({"separate_reasoning", "stream_reasoning", "include_reasoning", "parallel_tool_calls",
                      "metadata", "service_tier", "return_text", "request_id", "reasoning_effort"})

_COMMON = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                     "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs", "user",
                     "priority", "speculative", "prompt_logprobs", "n", kv_transfer.FIELD}) | CONSTRAINT_FIELDS \
    | PENALTY_FIELDS
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of"} | set(_NEUTRAL) | _IGNORED
CHAT_FIELDS = _COMMON | {"messages", "top_logprobs", "add_generation_prompt", "chat_template_kwargs"} \
    | set(_NEUTRAL) | _IGNORED


def ask_logprobs(req: GenerateRequest) -> None:
    """The wire fields of what a request asks of log-probabilities (engine/http/logprob_objects.py answers)."""
    if req.top_logprobs:
        req.sampling["top_logprobs"] = req.top_logprobs
    wire = req.prompt_logprobs  # asked as such (vLLM's extension)
    if req.echo and req.logprobs:  # echo with logprobs: the prompt tokens' too, with as many alternatives
        wire = max(wire or 0, req.top_logprobs)
    if req.sampling.get("max_tokens") == 0:
        if not req.echo:
            raise bad("max_tokens", "must be >= 1 (0 only with echo)")
        if wire is None:
            wire = 0  # the scheduler computes the prompt and answers no token
    if wire is not None:
        req.sampling["prompt_logprobs"] = wire


def _check_fields(body: Any, known: frozenset | set) -> None:
    if type(body) is not dict:
        raise bad(None, "the request body must be a JSON object", "invalid_type")
    for name in body:
        if name not in known:
            raise bad(name, "unrecognized request argument", "unknown_field")
    for name, (neutral, what) in _NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise bad(name, what, "unsupported_value")
    for name in ("separate_reasoning", "stream_reasoning", "include_reasoning", "parallel_tool_calls"):
        if body.get(name) is not None:
            _bool(name, body[name])


def _common(body: dict, kind: str, default_temperature: float) -> GenerateRequest:
    model = body.get("model")
    if model is not None and (type(model) is not str or not model):
        raise bad("model", "must be a non-empty string", "invalid_type")
    stream = _bool("stream", body["stream"]) if body.get("stream") is not None else False
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if type(opts) is not dict or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "must be an object with include_usage", "invalid_type")
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        include_usage = _bool("stream_options.include_usage", opts.get("include_usage", False))
        if opts.get("continuous_usage_stats"):
            raise bad("stream_options.continuous_usage_stats", "is not supported", "unsupported_value")
    user = body.get("user")
    if user is not None and type(user) is not str:
        raise bad("user", "must be a string", "invalid_type")
    sampling: dict = {}
    mct = body.get("max_completion_tokens")
    mt = mct if mct is not None else body.get("max_tokens")
    name = "max_completion_tokens" if mct is not None else "max_tokens"
    sampling["max_tokens"] = None if mt is None else _int(name, mt, 0, MAX_TOKENS)  # 0: echo only (below)
    t = body.get("temperature")
    temperature = default_temperature if t is None else _num("temperature", t, 0.0, 100.0)
    sampling["temperature"] = temperature
    if body.get("top_p") is not None:
        sampling["top_p"] = _num("top_p", body["top_p"], 0.0, 1.0, lo_open=True)
    if body.get("top_k") is not None:
        k = _int("top_k", body["top_k"], -1, 2**31 - 1)
        sampling["top_k"] = max(k, 0)  # vLLM's -1 = off, ours is 0
    seed = body.get("seed")
    if seed is not None:
        sampling["seed"] = _int("seed", seed, -(2**63), 2**64 - 1) & (2**64 - 1)
    elif temperature > 0:
        sampling["seed"] = secrets.randbits(63)  # OpenAI: no seed = a different sample each time
    stops = parse_stop(body.get("stop"))
    if stops:
        sampling["stop"] = stops
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if ids != []:
            ids = _token_ids("stop_token_ids", ids)
            if len(ids) > 256:
                raise bad("stop_token_ids", f"at most 256 ids, got {len(ids)}")
            sampling["stop_token_ids"] = ids
    if body.get("ignore_eos") is not None:
        sampling["ignore_eos"] = _bool("ignore_eos", body["ignore_eos"])
    if body.get("priority") is not None:
        sampling["priority"] = _int("priority", body["priority"], -100, 100)
    spec = body.get("speculative")  # extension: "off" | "ngram" (null: the board's default)
    if spec is not None:
        if spec not in SPECULATIVE_METHODS:
            raise bad("speculative", f"must be one of {', '.join(SPECULATIVE_METHODS)}, got {spec!r}")
        sampling["speculative"] = spec
    constraint = constraint_of(body)
    if constraint is not None:
        sampling["constraint"] = constraint
    sampling.update(penalty_fields(body))
    req = GenerateRequest(kind, model, stream, include_usage, False, user, sampling)
    req.handoff = kv_transfer.handoff_of(body.get(kv_transfer.FIELD))
    if body.get("n") is not None:
        req.n = _int("n", body["n"], 1, MAX_CHOICES)
    if body.get("best_of") is not None:
        req.best_of = _int("best_of", body["best_of"], req.n, MAX_CHOICES)
        if stream and req.best_of > req.n:
            raise bad("best_of", "cannot be streamed (the best choices are known at the end)", "unsupported_value")
    if body.get("prompt_logprobs") is not None:
        req.prompt_logprobs = _int("prompt_logprobs", body["prompt_logprobs"], 0, MAX_TOP_LOGPROBS)
        if stream:
            raise bad("prompt_logprobs", "is returned only in a non-streamed response", "unsupported_value")
    return req


def parse_completion(body: Any, default_temperature: float = 1.0) -> GenerateRequest:
    """A /v1/completions body. `max_tokens` defaults to 16, as in OpenAI's API."""
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad("prompt", "is required", "missing_field")
    req = _common(body, "completion", default_temperature)
    req.prompts = parse_prompts(body["prompt"])
    if req.sampling["max_tokens"] is None:
        req.sampling["max_tokens"] = 16
    lp = body.get("logprobs")
    if lp is not None:
        if type(lp) is not int:
            raise bad("logprobs", f"must be an integer, got {lp!r}", "invalid_type")
        req.top_logprobs = _int("logprobs", lp, 0, MAX_TOP_LOGPROBS)  # OpenAI's cap is 5, vLLM's 20
        req.logprobs = True
    if body.get("echo") is not None:
        req.echo = _bool("echo", body["echo"])
    ask_logprobs(req)
    return req


ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if type(m) is not dict:
        raise bad(where, "must be an object with role and content", "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    content = m.get("content")
    if type(content) is list:
        parts = []
        for j, p in enumerate(content):
            if type(p) is not dict or p.get("type") != "text" or type(p.get("text")) is not str:
                raise bad(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                                                  "are supported", "unsupported_value")
            parts.append(p["text"])
        content = "".join(parts)
    elif content is None and role == "assistant":
        content = ""
    elif type(content) is not str:
        raise bad(f"{where}.content", "must be a string or a list of text parts", "invalid_type")
    if m.get("tool_calls"):
        raise bad(f"{where}.tool_calls", "tool calling is not supported", "unsupported_value")
    out = {"role": role, "content": content}
    if type(m.get("name")) is str:
        out["name"] = m["name"]
    return out


def parse_chat(body: Any, default_temperature: float = 1.0) -> GenerateRequest:
    """A /v1/chat/completions body; `max_tokens` stays None (the shell fills in what the context leaves)."""
    _check_fields(body, CHAT_FIELDS)
    msgs = body.get("messages", _MISSING)
    if msgs is _MISSING:
        raise bad("messages", "is required", "missing_field")
    if type(msgs) is not list or not msgs:
        raise bad("messages", "must be a non-empty list of messages", "invalid_type")
    if len(msgs) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(msgs)}")
    req = _common(body, "chat", default_temperature)
    req.messages = [_message(i, m) for i, m in enumerate(msgs)]
    lp = body.get("logprobs")
    if lp is not None:
        req.logprobs = _bool("logprobs", lp)
    tlp = body.get("top_logprobs")
    if tlp is not None:
        req.top_logprobs = _int("top_logprobs", tlp, 0, MAX_TOP_LOGPROBS)
        if tlp and not req.logprobs:
            raise bad("top_logprobs", "needs logprobs = true")
    ask_logprobs(req)
    if body.get("add_generation_prompt") is not None:
        req.add_generation_prompt = _bool("add_generation_prompt", body["add_generation_prompt"])
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if type(kw) is not dict:
            raise bad("chat_template_kwargs", "must be an object", "invalid_type")
        req.template_kwargs = dict(kw)
    return req
