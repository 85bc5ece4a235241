"""Checks of `generate` and `cancel`: streaming and not, usage, seeds in a crowd, cancels, deadlines, ids.

Each check returns a short note on success and raises `Fail` (or `Skip`)
otherwise; `Env.conn()` gives it fresh connections whose messages are all
checked against the one-event-per-message rule by the runner.
"""

from __future__ import annotations

from tools.conformance.env import Env, gen, op
from tools.conformance.shapes import Fail, Skip, error_event, expect, generate_result, short

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
    return f"stopped after {k} tokens; completion_tokens {counted} ({'with' if counted > k else 'without'} the stop id)"


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


def check_single_frame_messages(env: Env) -> str:
    """Without `hello`, concurrent streams on one connection still arrive one event per message."""
    c = env.conn()
    ids = []
    for i in range(12):
        rid = env.rid(str(i))
        c.send(gen(rid, env.target.prompt(200 + i), max_tokens=16, ignore_eos=True))
        ids.append(rid)
    got = c.collect(ids)
    for rid in ids:
        generate_result(got[rid], stream=True, text=env.target.text)
    expect(not c.violations, c.violations[0] if c.violations else "")
    return f"{c.messages} messages, each one frame"


def _first_tokens(c, rid: str) -> list[dict]:
    """Events of `rid` up to and including its first tokens event (or its terminal event)."""
    evs = []
    while True:
        ev = c.next_event()
        if ev.get("id") != rid:
            raise Fail(f"an event for an id not sent on this connection: {short(ev)}")
        evs.append(ev)
        if ev["ev"] in ("tokens", "done", "error"):
            return evs


def check_cancel(env: Env) -> str:
    """cancel (twice, and of an unknown id) has no reply; the request ends with done/cancelled."""
    c = env.conn()
    p = env.target.prompt(7)
    n = env.target.long_max_tokens(len(p))
    rid = env.rid()
    c.send(gen(rid, p, max_tokens=n, ignore_eos=True))
    evs = _first_tokens(c, rid)
    c.send(op("cancel", rid))
    c.send(op("cancel", rid))
    c.send(op("cancel", env.rid("unknown")))
    evs += c.collect([rid])[rid]
    r = generate_result(evs, stream=True, text=env.target.text, daemon=env.daemon)
    reason = r["done"]["finish_reason"]
    probe = env.rid("health")
    ev = c.request(op("health", probe))  # in order on one connection: a cancel's reply would come first
    expect(ev.get("id") == probe and ev["ev"] == "health", f"a cancel was answered: {short(ev)}")
    late = c.quiet(SETTLE_S)
    expect(not late, f"events after the health reply: {short(late)}")
    if reason == "cancelled":
        return f"cancelled after {len(r['tokens'])} of {n} tokens"
    expect(reason == "length" and len(r["tokens"]) == n,
           f"after a cancel the request must end cancelled (or naturally): {reason}, {len(r['tokens'])} tokens")
    return f"finished all {n} tokens before the cancel arrived (allowed; cancellation not exercised)"


def check_cancel_finished(env: Env) -> str:
    """Cancelling a request that already finished is a no-op with no reply."""
    c = env.conn()
    rid = env.rid()
    run_one(env, gen(rid, env.target.prompt(8), max_tokens=2), conn=c)
    c.send(op("cancel", rid))
    probe = env.rid("health")
    ev = c.request(op("health", probe))
    expect(ev.get("id") == probe and ev["ev"] == "health", f"a cancel of a finished id was answered: {short(ev)}")
    return "no reply"


def check_duplicate_id(env: Env) -> str:
    """A second generate with an id in flight gets 400 duplicate_id; the first continues."""
    c = env.conn()
    p = env.target.prompt(9)
    n = env.target.long_max_tokens(len(p))
    rid = env.rid()
    first = gen(rid, p, max_tokens=n, ignore_eos=True)
    c.send(first)
    evs = _first_tokens(c, rid)
    if evs[-1]["ev"] != "tokens":
        raise Fail(f"the long request ended at once: {short(evs[-1])}")
    c.send(gen(rid, p, max_tokens=2))
    errors = []
    while True:  # the duplicate's error comes among the first request's tokens
        ev = c.next_event()
        if ev["ev"] == "error":
            errors.append(ev)
            break
        evs.append(ev)
        if ev["ev"] == "done":
            break
    expect(len(errors) == 1, f"no duplicate_id error before the first request ended ({n} tokens)")
    error_event(errors[0], 400, "duplicate_id", rid)
    expect(errors[0]["retryable"] is False, f"400 duplicate_id must not be retryable: {short(errors[0])}")
    if evs[-1]["ev"] != "done":
        c.send(op("cancel", rid))
        evs += c.collect([rid])[rid]
    r = generate_result(evs, stream=True, text=env.target.text)
    expect(r["done"]["finish_reason"] in ("cancelled", "length"), f"the first request did not continue: {r['done']}")
    return "duplicate refused, first continued to its own end"


def check_ids_per_connection(env: Env) -> str:
    """The same id on two connections is two requests."""
    a, b = env.conn(), env.conn()
    rid = env.rid()
    p = env.target.prompt(10)
    a.send(gen(rid, p, max_tokens=3, ignore_eos=True))
    b.send(gen(rid, p, max_tokens=3, ignore_eos=True))
    ra = generate_result(a.collect([rid])[rid], stream=True, text=env.target.text)
    rb = generate_result(b.collect([rid])[rid], stream=True, text=env.target.text)
    expect(len(ra["tokens"]) == len(rb["tokens"]) == 3, "both requests must run to their 3 tokens")
    return "both served"


def check_deadline(env: Env) -> str:
    """A request that cannot finish within deadline_ms ends with error 504."""
    c = env.conn()
    p = env.target.prompt(11)
    n = env.target.long_max_tokens(len(p))
    rid = env.rid()
    c.send(gen(rid, p, max_tokens=n, ignore_eos=True, deadline_ms=1))
    evs = c.collect([rid])[rid]
    last = evs[-1]
    expect(all(e["ev"] == "tokens" for e in evs[:-1]), f"only tokens events may precede the error: {evs[:-1][:3]}")
    expect(last["ev"] == "error", f"deadline_ms 1 for {n} tokens should end in 504, got {short(last)}")
    error_event(last, 504, None, rid)
    return f"504 {last['reason']}"


def check_model_not_found(env: Env) -> str:
    c = env.conn()
    rid = env.rid()
    c.send(gen(rid, env.target.prompt(12), model="conformance-no-such-model", max_tokens=2))
    error_event(c.collect([rid])[rid][-1], 404, "model_not_found", rid)
    return "404 model_not_found"


def check_second_model(env: Env) -> str:
    alias = env.opts.second_model
    if not alias:
        raise Skip("needs --second-model ALIAS (an alias the endpoint serves beside the default)")
    c = env.conn()
    rid = env.rid()
    listed = c.request(op("models", rid))
    aliases = [m.get("alias") for m in listed.get("models") or []]
    expect(alias in aliases, f"models does not list {alias!r}: {aliases}")
    r = run_one(env, gen(env.rid(), env.target.prompt(13), model=alias, max_tokens=3, ignore_eos=True))
    if env.daemon:
        gens = [m.get("generation") for m in listed["models"] if m.get("alias") == alias]
        expect(r["done"].get("generation") in gens,
               f"done.generation {r['done'].get('generation')!r} is not one models lists for {alias}: {gens}")
    return f"{alias} served"


def check_overload(env: Env) -> str:
    """A burst larger than the waiting room gets retryable 429s; every request still ends exactly once."""
    n = env.opts.overload
    if not n:
        raise Skip("needs --overload N (a burst that overflows the endpoint's admission.max_waiting_requests)")
    c = env.conn()
    p = env.target.prompt(14)
    long_n = env.target.long_max_tokens(len(p))
    ids = []
    for i in range(n):
        rid = env.rid(str(i))
        c.send(gen(rid, p, max_tokens=long_n, ignore_eos=True))
        ids.append(rid)
    got: dict[str, list[dict]] = {i: [] for i in ids}
    rejected = []
    ended: set[str] = set()
    cancelled = False
    while len(ended) < len(ids):
        ev = c.next_event()
        rid = str(ev.get("id"))
        expect(rid in got, f"an event for an id not sent: {short(ev)}")
        got[rid].append(ev)
        if ev["ev"] in ("done", "error"):
            ended.add(rid)
            if ev["ev"] == "error" and ev.get("code") == 429:
                rejected.append(ev)
        # once a 429 came, or every request has been heard from, the admitted ones are not needed any more
        if not cancelled and (rejected or all(got[i] for i in ids)):
            cancelled = True
            for other in ids:
                c.send(op("cancel", other))
    for rid in ids:
        evs = got[rid]
        if evs[-1]["ev"] == "error":
            expect(len([e for e in evs if e["ev"] in ("done", "error")]) == 1, f"{rid}: two terminal events")
            error_event(evs[-1])
        else:
            generate_result(evs, stream=True, text=env.target.text)
    expect(bool(rejected), f"a burst of {n} long requests got no 429 (is --overload above the waiting room?)")
    for ev in rejected:
        error_event(ev, 429)
        expect(ev["retryable"] is True, f"429 must be retryable: {short(ev)}")
    late = c.quiet(SETTLE_S)
    expect(not late, f"events after every request ended: {short(late)}")
    return f"{len(rejected)} of {n} got 429 {sorted({e['reason'] for e in rejected})}"


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
