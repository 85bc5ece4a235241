"""`npuserve generate`: send one generate request and print the tokens.

Text is byte-level (the tiny model's vocabulary): the UTF-8 bytes of `--text`
are the prompt token ids, and generated ids below 256 are decoded back to
bytes; other ids (EOS, specials) are shown as <id>.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from engine.client import Client, default_endpoint
from engine.errors import ClientError


def text_to_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def tokens_to_text(tokens: list[int]) -> str:
    """Bytes < 256 decoded as UTF-8 (invalid sequences replaced); other ids as <id>."""
    out: list[str] = []
    run = bytearray()
    for t in tokens:
        if 0 <= t < 256:
            run.append(t)
            continue
        if run:
            out.append(run.decode("utf-8", "replace"))
            run.clear()
        out.append(f"<{t}>")
    if run:
        out.append(run.decode("utf-8", "replace"))
    return "".join(out)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve generate", description="Send one generate request.")
    p.add_argument("--endpoint", default=None, help="daemon or balancer endpoint (default: the `make run` one)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-tokens", type=_int_list, help="comma-separated token ids")
    src.add_argument("--text", help="prompt text (its UTF-8 bytes are the token ids)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop-token-ids", type=_int_list)
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--deadline-ms", type=int)
    p.add_argument("--tenant")
    p.add_argument("--model")
    p.add_argument("--logprobs", action="store_true", default=None)
    p.add_argument("--no-stream", action="store_true", help="wait for the whole answer instead of streaming")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before giving up (default 60)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    prompt = a.prompt_tokens if a.prompt_tokens is not None else text_to_tokens(a.text)
    sampling = {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
                "seed": a.seed, "stop_token_ids": a.stop_token_ids, "ignore_eos": a.ignore_eos,
                "deadline_ms": a.deadline_ms, "tenant": a.tenant, "model": a.model, "logprobs": a.logprobs}
    sampling = {k: v for k, v in sampling.items() if v is not None}
    as_text = a.text is not None
    try:
        with Client(a.endpoint or default_endpoint(), timeout=a.timeout) as c:
            if a.json or a.no_stream:
                r = c.generate(prompt, **sampling)
                if not a.json:
                    print(tokens_to_text(r.tokens) if as_text else ",".join(map(str, r.tokens)))
            else:
                sink: list = []
                first = True
                for chunk in c.stream(prompt, result=sink, **sampling):
                    if as_text:
                        sys.stdout.write(tokens_to_text(chunk))
                    else:
                        sys.stdout.write(("" if first else ",") + ",".join(map(str, chunk)))
                    first = False
                    sys.stdout.flush()
                sys.stdout.write("\n")
                r = sink[0]
    except ClientError as e:
        print(f"npuserve generate: {e}", file=sys.stderr)
        return 1
    if a.json:
        out = {"tokens": r.tokens, "text": tokens_to_text(r.tokens), "finish_reason": r.finish_reason,
               "usage": r.usage, "timing": r.timing}
        if r.logprobs is not None:
            out["logprobs"] = r.logprobs
        sys.stdout.buffer.write(orjson.dumps(out) + b"\n")
    else:
        u = r.usage
        print(f"[{r.finish_reason}; prompt {u.get('prompt_tokens')} + completion {u.get('completion_tokens')} "
              f"tokens, cached {u.get('cached_tokens')}; ttft {_ms(r.timing.get('ttft_ms'))}, "
              f"e2e {_ms(r.timing.get('e2e_ms'))}]", file=sys.stderr)
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f} ms"
