"""OpenAI's log-probability objects with alternatives and the prompt's (echo), from the wire's fields.

The wire gives, per generated token, `top_logprobs` [[id, logprob], ...] and,
once, `prompt_logprobs` {tokens, logprobs (the first null), top_logprobs}
(docs/protocol.md). Here the prompt's become the legacy completions object of
the echoed prompt (`tokens`, `token_logprobs`, `top_logprobs` as {text: logprob}
dicts, the first null, `text_offset`) joined before the completion's, and vLLM's
`prompt_logprobs` list; the generated tokens' alternatives are shaped by
`openai_response.completion_logprobs` / `chat_logprobs`.
"""

from __future__ import annotations

from engine.http.openai_response import TokenText, completion_choice, completion_logprobs


def echo_logprobs(prompt_lp: dict, token_text: TokenText, with_tops: bool) -> dict:
    """The legacy completions logprobs object of the prompt's tokens (echo): the first token's logprob null."""
    texts = [token_text(t) for t in prompt_lp["tokens"]]
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    tops = None
    if with_tops:
        tops = [None] + [{token_text(i): lp for i, lp in t} for t in prompt_lp["top_logprobs"][1:]]
    return {"tokens": texts, "token_logprobs": list(prompt_lp["logprobs"]), "top_logprobs": tops,
            "text_offset": offsets}


def joined(first: dict, second: dict | None) -> dict:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    if second is None:
        return first
    tops = None
    if first["top_logprobs"] is not None or second["top_logprobs"] is not None:
        tops = (first["top_logprobs"] or [None] * len(first["tokens"])) + \
            (second["top_logprobs"] or [None] * len(second["tokens"]))
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"], "top_logprobs": tops,
            "text_offset": first["text_offset"] + second["text_offset"]}


def prompt_text(prompt, token_text: TokenText) -> str:
    """The echoed prompt: the text sent, or the token ids' texts joined."""
    return prompt if type(prompt) is str else "".join(token_text(t) for t in prompt)


def vllm_prompt_logprobs(prompt_lp: dict | None, token_text: TokenText) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {id: {logprob, rank, decoded_token}} with the
    prompt token and its alternatives (rank: its place among them, 1 = most likely; null when not among them)."""
    if prompt_lp is None:
        return None
    out: list = [None]
    for t, lp, top in zip(prompt_lp["tokens"][1:], prompt_lp["logprobs"][1:], prompt_lp["top_logprobs"][1:]):
        ranks = {i: r for r, (i, _) in enumerate(top, 1)}
        entry = {str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": token_text(t)}}
        for r, (i, v) in enumerate(top, 1):
            entry.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": token_text(i)})
        out.append(entry)
    return out


def completion_answer(req, index: int, done: dict, prompt, token_text: TokenText) -> dict:
    """One completions choice from its `done` event: the echoed prompt first (with its logprobs when asked),
    the completion's alternatives, and vLLM's `prompt_logprobs` when asked for as such."""
    lp = None
    if req.logprobs:
        tops = done.get("top_logprobs") if req.top_logprobs else None
        lp = completion_logprobs(done.get("tokens") or [], done.get("logprobs") or [], token_text, tops=tops)
    text = done.get("text") or ""
    if req.echo:
        shown = prompt_text(prompt, token_text)
        if lp is not None and done.get("prompt_logprobs") is not None:
            if lp["text_offset"]:
                lp["text_offset"] = [o + len(shown) for o in lp["text_offset"]]
            lp = joined(echo_logprobs(done["prompt_logprobs"], token_text, bool(req.top_logprobs)), lp)
        text = shown + text
    choice = completion_choice(index, text, done.get("finish_reason"), lp)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(done.get("prompt_logprobs"), token_text)
    return choice
