"""One streamed response's SSE bytes, batch by batch: upstream events in, bytes out (pure).

A batch is every upstream event of one choice that arrived in one receive
burst; it leaves as one write: one chunk with the text of its `tokens`
events joined (and their logprobs), then the choice's end if the batch has it.
"""

from __future__ import annotations

from engine.http.openai_error import from_upstream
from engine.http.logprob_objects import echo_logprobs
from engine.http.openai_response import ChunkWriter, TokenText, chat_logprobs, completion_logprobs


class StreamEncoder:
    """`encode(choice, batch)` -> the bytes of one write; an upstream `error` event raises its OpenAIError.

    A batch that carries tokens leaves as a chunk even when their text is held
    back upstream (the first bytes of a UTF-8 character, the start of a
    possible stop string): its delta is then empty, as vLLM sends it. So the
    client sees every token as it arrives, its first one included (the TTFT
    it measures), instead of one decode step or more later with the next
    token that completes the text.
    """

    __slots__ = ("writer", "chat", "logprobs", "token_text", "usages", "left", "started", "echo")

    def __init__(self, writer: ChunkWriter, choices: int, *, logprobs: bool, token_text: TokenText,
                 echo: list[str] | None = None) -> None:
        self.writer = writer
        self.chat = writer.kind == "chat"
        self.logprobs = logprobs
        self.token_text = token_text
        self.usages: list[dict | None] = [None] * choices  # each choice's `done.usage`, once it ended
        self.left = choices  # choices not ended yet
        self.started = False  # some choice has had tokens
        self.echo = echo  # completions with echo: each choice's prompt text, until its first chunk

    def head(self) -> bytes:
        """What precedes the first batch: a chat stream's assistant-role delta per choice."""
        return b"".join(self.writer.role(i) for i in range(len(self.usages))) if self.chat else b""

    def encode(self, i: int, batch: list[dict]) -> bytes:
        texts: list[str] = []
        toks: list[int] = []
        lps: list[float] = []
        tops: list | None = None
        had_tokens = False
        end = None
        out = []
        for ev in batch:
            if ev.get("ev") == "tokens":
                texts.append(ev.get("text") or "")
                if ev.get("tokens"):
                    had_tokens = True
                if self.logprobs:
                    toks.extend(ev.get("tokens") or ())
                    lps.extend(ev.get("logprobs") or ())
                    if "top_logprobs" in ev:
                        tops = (tops or []) + ev["top_logprobs"]
                if "prompt_logprobs" in ev and self.echo is not None:
                    out.append(self._echo(i, ev["prompt_logprobs"]))
            else:
                end = ev
        if self.echo is not None and self.echo[i] is not None:  # echo without logprobs: the prompt's text
            out.append(self._echo(i, None))
        self.started = self.started or had_tokens
        text = "".join(texts)
        if text or toks or (had_tokens and end is None):  # a batch with its end needs no empty delta
            lp = None
            if self.logprobs:
                lp = (chat_logprobs if self.chat else completion_logprobs)(toks, lps, self.token_text, tops=tops)
            out.append(self.writer.text(i, text, lp))
        if end is not None:
            if end.get("ev") == "error":
                raise from_upstream(end)
            out.append(self.writer.finish(i, end.get("finish_reason")))
            self.usages[i] = end.get("usage") or {}
            self.left -= 1
        return b"".join(out)

    def _echo(self, i: int, prompt_lp: dict | None) -> bytes:
        """Choice i's echoed prompt as its first chunk (with its logprobs when the request asked)."""
        text, self.echo[i] = self.echo[i], None
        if text is None:
            return b""
        lp = echo_logprobs(prompt_lp, self.token_text, True) if prompt_lp is not None and self.logprobs else None
        return self.writer.text(i, text, lp)

    def tail(self) -> bytes:
        """The usage chunk (with `stream_options.include_usage`), summed over the choices that ended."""
        w = self.writer
        return w.usage([u for u in self.usages if u is not None]) if w.include_usage else b""
