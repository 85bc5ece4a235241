"""`npuserve generate`: send one generate request and print the answer.

`--text` sends text and prints the text the daemon decodes with the model's
own tokenizer (streamed as it comes, never half a character); `--prompt-tokens`
sends token ids and prints the generated ids. `--stop` ends the answer at a
string (repeatable).
"""

from __future__ import annotations

import argparse
import sys

import orjson

from engine.client import Client, default_endpoint
from engine.errors import ClientError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _bias(text: str) -> tuple[str, float]:
    """ID=BIAS -> (the wire's key: the id in decimal, the bias)."""
    try:
        tid, bias = text.split("=", 1)
        return str(int(tid)), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 42=-100), got {text!r}") from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve generate", description="Send one generate request.")
    p.add_argument("--endpoint", default=None, help="daemon or balancer endpoint (default: the `make run` one)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-tokens", type=_int_list, help="comma-separated token ids")
    src.add_argument("--text", help="prompt text (the daemon tokenizes it; the answer is printed as text)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop-token-ids", type=_int_list)
    p.add_argument("--presence-penalty", type=float, help="-2..2, subtracted once from each generated token's logit")
    p.add_argument("--frequency-penalty", type=float, help="-2..2, subtracted per occurrence in the output")
    p.add_argument("--repetition-penalty", type=float, help="> 0, over prompt and output tokens (1 = off)")
    p.add_argument("--min-p", type=float, help="0..1, drop tokens below min_p times the top probability")
    p.add_argument("--min-tokens", type=int, help="no EOS or stop token id before this many tokens")
    p.add_argument("--logit-bias", action="append", metavar="ID=BIAS", type=_bias,
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")
    p.add_argument("--stop", action="append", metavar="STRING",
                   help="end the answer before this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--deadline-ms", type=int)
    p.add_argument("--tenant")
    p.add_argument("--model")
    p.add_argument("--logprobs", action="store_true", default=None)
    p.add_argument("--top-logprobs", type=int, metavar="N", help="also each token's N most likely alternatives")
    p.add_argument("--prompt-logprobs", type=int, metavar="N",
                   help="also the prompt tokens' logprobs, with N alternatives (--max-tokens 0: only those)")
    p.add_argument("--no-stream", action="store_true", help="wait for the whole answer instead of streaming")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before giving up (default 60)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    prompt = a.prompt_tokens if a.prompt_tokens is not None else a.text
    sampling = {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
                "seed": a.seed, "stop_token_ids": a.stop_token_ids, "stop": a.stop, "ignore_eos": a.ignore_eos,
                "deadline_ms": a.deadline_ms, "tenant": a.tenant, "model": a.model, "logprobs": a.logprobs,
                "top_logprobs": a.top_logprobs, "prompt_logprobs": a.prompt_logprobs,
                "presence_penalty": a.presence_penalty, "frequency_penalty": a.frequency_penalty,
                "repetition_penalty": a.repetition_penalty, "min_p": a.min_p, "min_tokens": a.min_tokens,
                "logit_bias": dict(a.logit_bias) if a.logit_bias else None}

    sampling = {k: v for k, v in sampling.items() if v is not None}
    as_text = a.text is not None
    try:
        with Client(a.endpoint or default_endpoint(), timeout=a.timeout) as c:
            if a.json or a.no_stream:
                r = c.generate(prompt, **sampling)
                if not a.json:
                    print(r.text or "" if as_text else ",".join(map(str, r.tokens)))
            elif as_text:
                sink: list = []
                for delta in c.stream_text(prompt, result=sink, **sampling):
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                r = sink[0]
            else:
                sink = []
                first = True
                for chunk in c.stream(prompt, result=sink, **sampling):
                    sys.stdout.write(("" if first else ",") + ",".join(map(str, chunk)))
                    first = False
                    sys.stdout.flush()
                sys.stdout.write("\n")
                r = sink[0]
    except ClientError as e:
        print(f"npuserve generate: {e}", file=sys.stderr)
        return 1
    if a.json:
        out = {"tokens": r.tokens, "text": r.text, "finish_reason": r.finish_reason,
               "usage": r.usage, "timing": r.timing}
        if r.logprobs is not None:
            out["logprobs"] = r.logprobs
        if r.top_logprobs is not None:
            out["top_logprobs"] = r.top_logprobs
        if r.prompt_logprobs is not None:
            out["prompt_logprobs"] = r.prompt_logprobs
        sys.stdout.buffer.write(orjson.dumps(out) + b"\n")
    else:
        u = r.usage
        print(f"[{r.finish_reason}; prompt {u.get('prompt_tokens')} + completion {u.get('completion_tokens')} "
              f"tokens, cached {u.get('cached_tokens')}; ttft {_ms(r.timing.get('ttft_ms'))}, "
              f"e2e {_ms(r.timing.get('e2e_ms'))}]", file=sys.stderr)
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f} ms"
