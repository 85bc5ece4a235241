"""Speculation on constrained requests (structured output) through a real daemon and ref worker: the output
equals `speculative: "off"` token for token, and the constrained lanes' drafts are accepted."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine.async_client import AsyncClient

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["n", "kind"], "additionalProperties": False}
# copy-heavy: the output repeats words the prompt (and the output itself) already holds, and inside a word
# the grammar leaves one choice, which n-gram drafts propose
WORDS = r"(abc|abd|xyz)( (abc|abd|xyz)){9}"
COPY_PROMPT = "abc abd xyz abc xyz abd abc abc xyz abd "


def test_constrained_speculation_equals_plain_decoding_and_accepts_drafts(daemon):
    d = daemon(backend="ref", chips=1, settings={"speculative.method": "ngram", "speculative.max_draft_tokens": 4})
    cases = [(COPY_PROMPT, {"kind": "regex", "body": WORDS}, 0.0, 0),
             (COPY_PROMPT * 2, {"kind": "regex", "body": WORDS}, 0.0, 0),
             ("Data:", {"kind": "json_schema", "body": SCHEMA}, 0.0, 0),
             ("Data:", {"kind": "json_schema", "body": SCHEMA}, 1.0, 5)]

    async def run(spec):
        async with AsyncClient(d.endpoint, timeout=120) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=64, temperature=t, seed=s, constraint=con,
                                                     logprobs=True, speculative=spec)
                                          for p, con, t, s in cases))

    plain = asyncio.run(run("off"))
    with d.client(timeout=10) as c:
        before = c.stats()["scheduler"]["speculative"]  # start-up checks may have drafted
    drafted = asyncio.run(run(None))
    for p, s in zip(plain, drafted):
        assert s.tokens == p.tokens and s.finish_reason == p.finish_reason == "eos"
        assert s.logprobs == pytest.approx(p.logprobs, abs=1e-3)
    for (_, con, _, _), r in zip(cases, drafted):
        if con["kind"] == "regex":
            assert re.fullmatch(WORDS, r.text), r.text
        else:
            jsonschema.validate(json.loads(r.text), SCHEMA)
    with d.client(timeout=10) as c:
        st = c.stats()
    sp = st["scheduler"]["speculative"]
    drafts = sp["constrained"]["num_drafts"] - before["constrained"]["num_drafts"]
    accepted = sp["constrained"]["num_accepted_tokens"] - before["constrained"]["num_accepted_tokens"]
    assert drafts == sp["num_drafts"] - before["num_drafts"] > 0, (before, sp)  # every request is constrained
    assert accepted == sp["num_accepted_tokens"] - before["num_accepted_tokens"] > 0, (before, sp)
    for chip in st["scheduler"]["chips"].values():
        assert chip["kv"]["blocks"]["used"] == 0 and chip["kv"]["blocks"]["quarantined"] == 0
