"""Checks of `generate` itself: streaming and not, usage, logprobs, text, stops, continuation, constraints, seeds.

Each check returns a short note on success and raises `Fail` (or `Skip`)
otherwise; `Env.conn()` gives it fresh connections whose messages are all
checked against the one-event-per-message rule by the runner.
"""

from __future__ import annotations

from tools.conformance.env import Env, gen
from tools.conformance.shapes import Skip, error_event, expect, generate_result, short

SETTLE_S = 0.3  # how long to watch for stray events after a terminal one (a late event is a violation)


def run_one(env: Env, msg: dict, *, stream: bool = True, logprobs: bool = False, conn=None) -> dict:
    """Send one generate, read it to its terminal event, check its shape; returns generate_result's dict."""
    c = conn or env.conn()
    c.send(msg)
    events = c.collect([msg["id"]])[msg["id"]]
    return generate_result(events, stream=stream, text=env.target.text, logprobs=logprobs, daemon=env.daemon,
                           prompt_len=len(msg["prompt"]) if "prompt" in msg else None)


def check_generate_stream(env: Env) -> str:
    p = env.target.prompt(1)
    r = run_one(env, gen(env.rid(), p, max_tokens=8, ignore_eos=True))
    expect(r["done"]["finish_reason"] == "length" and len(r["tokens"]) == 8,
           f"max_tokens 8 with ignore_eos must give 8 tokens and finish length: got {len(r['tokens'])}, "
           f"{r['done']['finish_reason']}")
    expect(all(0 <= t < env.target.vocab_size for t in r["tokens"]), f"token ids outside the vocabulary: {r['tokens']}")
    return f"8 tokens, {short(r['done']['timing'], 80)}"


def check_generate_no_stream(env: Env) -> str:
    """stream: false gives one done with every token; the same as the streamed request (greedy, same seed)."""
    p = env.target.prompt(2)
    streamed = run_one(env, gen(env.rid("s"), p, max_tokens=6, seed=5))
    whole = run_one(env, gen(env.rid("w"), p, max_tokens=6, seed=5, stream=False), stream=False)
    expect(whole["tokens"] == streamed["tokens"],
           f"stream: false gave {whole['tokens']}, the same request streamed gave {streamed['tokens']}")
    if env.target.text:
        expect(whole["text"] == streamed["text"], f"stream: false text {whole['text']!r} differs from the "
                                                  f"concatenated deltas {streamed['text']!r}")
    return f"{len(whole['tokens'])} tokens in done, equal to the stream"


def check_logprobs(env: Env) -> str:
    p = env.target.prompt(3)
    s = run_one(env, gen(env.rid("s"), p, max_tokens=5, ignore_eos=True, logprobs=True), logprobs=True)
    w = run_one(env, gen(env.rid("w"), p, max_tokens=5, ignore_eos=True, logprobs=True, stream=False),
                stream=False, logprobs=True)
    for lp in s["logprobs"] + w["logprobs"]:
        expect(isinstance(lp, (int, float)) and not isinstance(lp, bool) and lp <= 1e-6,
               f"a log-probability must be a number <= 0: {lp!r}")
    return "one per token, streamed and in done"


def check_text_prompt(env: Env) -> str:
    """With a tokenizer, `text` prompts work and every event has text; without one, `text` is 400 no_tokenizer."""
    c = env.conn()
    rid = env.rid()
    if not env.target.text:
        c.send(gen(rid, text="hello", max_tokens=2))
        ev = c.collect([rid])[rid][-1]
        error_event(ev, 400, "no_tokenizer", rid)
        return "no tokenizer: 400 no_tokenizer"
    c.send(gen(rid, text="Hello", max_tokens=4, ignore_eos=True))
    r = generate_result(c.collect([rid])[rid], stream=True, text=True, daemon=env.daemon)
    expect(len(r["tokens"]) == 4, f"max_tokens 4: got {len(r['tokens'])} tokens")
    return f"text prompt answered with text {r['text'][:20]!r}"


def check_stop_token_ids(env: Env) -> str:
    """A generated id listed in `stop_token_ids` ends the request with `stop`, the id itself not emitted."""
    p = env.target.prompt(4)
    base = run_one(env, gen(env.rid("g"), p, max_tokens=12, ignore_eos=True))["tokens"]
    k = next((i for i in range(1, len(base)) if base[i] not in base[:i]), None)
    if k is None:
        raise Skip(f"greedy output repeats one id ({base}): no token to stop at")
    r = run_one(env, gen(env.rid("s"), p, max_tokens=12, ignore_eos=True, stop_token_ids=[base[k]]))
    expect(r["done"]["finish_reason"] == "stop" and r["tokens"] == base[:k],
           f"stop_token_ids [{base[k]}] should end with stop after {base[:k]}, got {r['tokens']} "
           f"({r['done']['finish_reason']})")
    counted = r["done"]["usage"]["completion_tokens"]
    expect(counted == k + 1, f"completion_tokens {counted}: the {k} ids sent and the stop id generated make {k + 1}")
    return f"stopped after {k} tokens; completion_tokens {counted} (with the stop id)"


def check_every_field(env: Env) -> str:
    """A generate that sets every client field of the table to a valid value is accepted."""
    p = env.target.prompt(5)
    msg = gen(env.rid(), p, model=None, max_tokens=4, temperature=0.5, top_p=0.9, top_k=5, seed=2**64 - 1,
              stop_token_ids=[], stop=[], ignore_eos=False, deadline_ms=600000, tenant="conformance",
              priority=1, logprobs=True, stream=True, continuation=[], constraint=None, pool=None,
              speculative="off")
    r = run_one(env, msg, logprobs=True)
    return f"accepted, {len(r['tokens'])} tokens"


def _crowd(env: Env, n: int, lead: dict, conns: int = 3) -> dict[str, list[dict]]:
    """`lead` plus n - 1 other sampled requests, all sent before any is read, spread over a few connections."""
    cs = [env.conn() for _ in range(conns)]
    ids: list[list[str]] = [[] for _ in cs]
    for i in range(n):
        c = i % conns
        if i == n // 2:
            msg = lead
        else:
            msg = gen(env.rid(f"c{i}"), env.target.prompt(100 + i, 3 + i % 5), max_tokens=2 + i % 5,
                      temperature=0.9, seed=1000 + i, ignore_eos=bool(i % 2))
        cs[c].send(msg)
        ids[c].append(msg["id"])
    out: dict[str, list[dict]] = {}
    for c, mine in zip(cs, ids):
        out.update(c.collect(mine))
    for c in cs:
        late = c.quiet(SETTLE_S)
        expect(not late, f"events after the terminal events: {[(e['ev'], e.get('id')) for e in late][:5]}")
    return out


def check_seeded_crowd(env: Env) -> str:
    """Seeded sampling: the request alone and inside a crowd of concurrent requests gives the same tokens."""
    p = env.target.prompt(6, 9)
    fields = dict(max_tokens=6, temperature=0.8, top_k=0, top_p=1.0, seed=987654321, ignore_eos=True)
    alone = run_one(env, gen(env.rid("alone"), p, **fields))
    lead = gen(env.rid("lead"), p, **fields)
    got = _crowd(env, max(2, env.opts.crowd), lead)
    for rid, evs in got.items():
        generate_result(evs, stream=True, text=env.target.text, daemon=env.daemon)
    crowd = generate_result(got[lead["id"]], stream=True, text=env.target.text)
    expect(crowd["tokens"] == alone["tokens"],
           f"seed {fields['seed']}: alone {alone['tokens']}, in a crowd of {env.opts.crowd} {crowd['tokens']}")
    return f"{env.opts.crowd} concurrent, one terminal each, same tokens"


def run_concurrent_streams(env: Env, c, first_prompt: int, n: int = 12, context: str = "") -> None:
    """`n` streams at once on connection `c`, each checked whole; any framing violation on `c` fails (its
    message prefixed with `context`)."""
    ids = []
    for i in range(n):
        rid = env.rid(str(i))
        c.send(gen(rid, env.target.prompt(first_prompt + i), max_tokens=16, ignore_eos=True))
        ids.append(rid)
    got = c.collect(ids)
    for rid in ids:
        generate_result(got[rid], stream=True, text=env.target.text)
    expect(not c.violations, f"{context}{c.violations[0]}" if c.violations else "")


def check_single_frame_messages(env: Env) -> str:
    """Without `hello`, concurrent streams on one connection still arrive one event per message."""
    c = env.conn()
    run_concurrent_streams(env, c, 200)
    return f"{c.messages} messages, each one frame"


def check_stop_sequences(env: Env) -> str:
    """A token-id stop sequence ends with stop, its ids not emitted; a stop string cuts the text before it."""
    p = env.target.prompt(15)
    base = run_one(env, gen(env.rid("g"), p, max_tokens=16, ignore_eos=True, stream=False), stream=False)
    toks = base["tokens"]
    pairs = [tuple(toks[i:i + 2]) for i in range(len(toks) - 1)]
    k = next((i for i in range(1, len(pairs)) if pairs[i] not in pairs[:i] and toks[i] not in toks[:i]), None)
    notes = []
    if k is None:
        notes.append("no unrepeated id pair in the greedy output: id sequence not checked")
    else:
        r = run_one(env, gen(env.rid("ids"), p, max_tokens=16, ignore_eos=True, stop=[list(pairs[k])]))
        expect(r["done"]["finish_reason"] == "stop" and r["tokens"] == toks[:k],
               f"stop [{list(pairs[k])}] should end with stop after {toks[:k]}, got {r['tokens']} "
               f"({r['done']['finish_reason']})")
        notes.append(f"id sequence: {k} tokens")
    if not env.target.text:
        return "; ".join(notes + ["no tokenizer: stop strings not checked"])
    text = base["text"]
    j = next((i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i
              and text[i:i + 2].strip()), None)
    if j is None:
        return "; ".join(notes + [f"no usable substring in {text[:20]!r}: stop strings not checked"])
    s = text[j:j + 2]
    r = run_one(env, gen(env.rid("str"), p, max_tokens=16, ignore_eos=True, stop=[s]))
    expect(r["done"]["finish_reason"] == "stop",
           f"stop string {s!r} in {text!r}: finished {r['done']['finish_reason']}")
    expect(r["text"] == text[:j], f"stop string {s!r}: the text must end right before it: {text[:j]!r}, got "
                                  f"{r['text']!r}")
    expect(r["tokens"] == toks[:len(r["tokens"])] and 0 < len(r["tokens"]) <= len(toks),
           f"stop string: the ids up to the completing one are emitted: {r['tokens']} vs {toks}")
    expect(r["done"]["usage"]["completion_tokens"] == len(r["tokens"]),
           "stop string: completion_tokens counts the emitted ids")
    return "; ".join(notes + [f"string {s!r}: text cut, {len(r['tokens'])} ids emitted"])


def check_continuation(env: Env) -> str:
    """A continuation counts toward max_tokens, is not re-sent, and a seeded request resumes where it left off."""
    p = env.target.prompt(16)
    fields = dict(max_tokens=8, temperature=0.8, seed=4242, ignore_eos=True)
    whole = run_one(env, gen(env.rid("whole"), p, **fields))["tokens"]
    r = run_one(env, gen(env.rid("resumed"), p, continuation=whole[:3], **fields))
    expect(r["tokens"] == whole[3:], f"continuation {whole[:3]}: expected the rest {whole[3:]}, got {r['tokens']}")
    expect(r["done"]["finish_reason"] == "length", f"finish {r['done']['finish_reason']}, expected length")
    return "resumed after 3 of 8 tokens with the same seeded tokens"


def check_structured_output(env: Env) -> str:
    """A constraint that does not compile is 400 invalid_constraint; a regex constraint's text matches it."""
    import re

    c = env.conn()
    rid = env.rid("bad")
    c.send(gen(rid, env.target.prompt(17), max_tokens=4, constraint={"kind": "regex", "body": "(unclosed"}))
    ev = c.collect([rid])[rid][-1]
    error_event(ev, 400, None, rid)
    if ev["reason"] == "constraint_unsupported":
        return "400 constraint_unsupported (the backend samples on the device)"
    expect(ev["reason"] == "invalid_constraint", f"a regex that does not compile: expected invalid_constraint, got "
                                                 f"{ev['reason']}: {ev['message']}")
    if not env.target.text:
        return "invalid_constraint; no tokenizer: output not checked"
    ok = gen(env.rid("ok"), env.target.prompt(17), max_tokens=6, temperature=0.7, seed=9,
             constraint={"kind": "regex", "body": "[ab]{3}"})
    c.send(ok)
    evs = c.collect([ok["id"]])[ok["id"]]
    if evs[-1]["ev"] == "error" and evs[-1].get("reason") == "constraint_unsupported":
        error_event(evs[-1], 400, None, ok["id"])
        return "invalid_constraint; a valid one: 400 constraint_unsupported (the backend samples on the device)"
    r = generate_result(evs, stream=True, text=True, daemon=env.daemon, prompt_len=len(ok["prompt"]))
    done = r["done"]["finish_reason"]
    expect(re.fullmatch("[ab]{3}", r["text"]) is not None, f"regex [ab]{{3}}: the text {r['text']!r} ({done}) "
                                                           "does not match")
    return f"invalid_constraint; regex output {r['text']!r}"
