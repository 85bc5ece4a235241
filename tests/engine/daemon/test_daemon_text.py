"""Text in, text out through a real daemon: the tiny `ref` model (byte-level) and the `stub` backend."""

from __future__ import annotations

import asyncio
import codecs
import os
import subprocess
import sys

import pytest

from repo_root import ROOT
from engine.async_client import AsyncClient
from engine.errors import InvalidRequest
from ipc.codec import encode

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time, in a land far away"


def raw_events(c, msg: dict) -> list[dict]:
    """Send one raw generate and collect its events up to the terminal one."""
    rid = c.new_id()
    c.expect(rid)
    c.send_raw(encode({"v": 1, "op": "generate", "id": rid, **msg}))
    out = []
    while True:
        ev = c.next_event(rid)
        out.append(ev)
        if ev["ev"] != "tokens":
            return out


def byte_text(tokens: list[int], final: bool = True) -> str:
    """What a byte-level vocabulary decodes to: ids < 256 are bytes, the rest carry no text.

    `final=False`: the text known so far (a trailing incomplete character is not decided yet)."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(t for t in tokens if t < 256), final)


def test_ref_model_text_in_text_out(daemon):
    d = daemon(backend="ref", chips=1)
    sampling = {"max_tokens": 48, "temperature": 0.8, "seed": 11, "ignore_eos": True}
    with d.client(timeout=60) as c:
        assert c.health()["model"]["text"] is True
        # streamed deltas concatenate to the non-streamed text; ids ride along in every event
        streamed = raw_events(c, {"text": PROMPT, "stream": True, **sampling})
        *toks, done = streamed
        assert done["ev"] == "done" and "text" not in done  # streaming: the deltas are the text
        assert toks and all("text" in ev and "tokens" in ev for ev in toks)
        s_text = "".join(ev["text"] for ev in toks)
        s_ids = [t for ev in toks for t in ev["tokens"]]
        (whole,) = raw_events(c, {"text": PROMPT, "stream": False, **sampling})
        assert whole["finish_reason"] == "length" and whole["usage"]["prompt_tokens"] == len(PROMPT.encode())
        assert whole["text"] == s_text and whole["tokens"] == s_ids
        assert s_text == byte_text(s_ids)  # the tiny model's vocabulary is bytes

        # the client library: str prompt -> text request, Result.text, stream_text
        r = c.generate(PROMPT, **sampling)
        assert (r.text, r.tokens) == (s_text, s_ids)
        sink: list = []
        assert "".join(c.stream_text(PROMPT, result=sink, **sampling)) == s_text
        assert sink[0].text == s_text and sink[0].tokens == s_ids
        assert c.generate(list(PROMPT.encode()), **sampling).text == s_text  # ids in, text out too

        # a stop string: the text ends right before its first occurrence, finish_reason stop
        stop = s_text[20:23]
        cut = s_text[: s_text.find(stop)]
        for stream in (False, True):
            evs = raw_events(c, {"text": PROMPT, "stream": stream, "stop": [stop], **sampling})
            got = evs[-1]["text"] if not stream else "".join(ev["text"] for ev in evs[:-1])
            ids = evs[-1]["tokens"] if not stream else [t for ev in evs[:-1] for t in ev["tokens"]]
            assert evs[-1]["finish_reason"] == "stop" and got == cut
            # generation stopped at the token completing the stop string: its ids are shown, no more
            assert ids == s_ids[: len(ids)] and stop not in byte_text(ids[:-1], final=False)
            assert stop in byte_text(ids, final=False)
            assert evs[-1]["usage"]["completion_tokens"] == len(ids) < sampling["max_tokens"]

        # text and prompt together, or neither: 400 naming the problem; the daemon keeps serving
        (err,) = raw_events(c, {"text": "hi", "prompt": [1, 2]})
        assert (err["code"], err["reason"]) == (400, "conflicting_fields")
        assert "prompt" in err["message"] and "text" in err["message"]
        (err,) = raw_events(c, {"max_tokens": 3})
        assert (err["code"], err["reason"]) == (400, "missing_field") and "text" in err["message"]
        (err,) = raw_events(c, {"text": ""})
        assert (err["code"], err["reason"]) == (400, "out_of_range") and err["message"].startswith("text:")
        (err,) = raw_events(c, {"text": "x", "stop": [7]})
        assert (err["code"], err["reason"]) == (400, "bad_type") and err["message"].startswith("stop[0]:")
        with pytest.raises(InvalidRequest):
            c.generate("x", stop=[""])
        assert c.health()["ok"] is True

    async def async_side() -> tuple[str | None, str]:
        async with AsyncClient(d.endpoint, timeout=60) as ac:
            r = await ac.generate(PROMPT, **sampling)
            parts = [delta async for delta in ac.stream_text(PROMPT, **sampling)]
            return r.text, "".join(parts)

    assert asyncio.run(async_side()) == (s_text, s_text)


def test_stub_multibyte_output_is_never_split_and_cli_prints_text(daemon):
    d = daemon(backend="stub", chips=1)  # no package: the built-in byte-level vocabulary
    with d.client(timeout=60) as c:
        evs = raw_events(c, {"text": "hé", "max_tokens": 600, "seed": 3})
        text = "".join(ev["text"] for ev in evs[:-1])
        ids = [t for ev in evs[:-1] for t in ev["tokens"]]
        multibyte = [ch for ch in text if ord(ch) >= 0x80 and ch != "\ufffd"]
        assert len(multibyte) >= 3, "the workload must contain characters spread over several tokens"
        # a split character would show up as replacement characters instead of the character
        assert text == byte_text(ids)
        # a lead byte: its id now, its character with a later event
        assert any(ev["tokens"] and max(ev["tokens"]) < 256 and ev["text"] == "" for ev in evs[:-1])

        # a stop string made of a multi-byte character the stream produces
        stop = multibyte[1]
        r = c.generate("hé", max_tokens=600, seed=3, stop=[stop])
        assert r.finish_reason == "stop" and r.text == text[: text.find(stop)]

    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    base = [sys.executable, "-m", "tools.cli", "generate", "--endpoint", d.endpoint, "--text", "hé",
            "--max-tokens", "600", "--seed", "3"]
    for extra in ([], ["--no-stream"]):
        out = subprocess.run(base + extra, cwd=ROOT, capture_output=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.decode("utf-8") == text + "\n"
        assert b"[length;" in out.stderr
    out = subprocess.run(base + ["--stop", stop], cwd=ROOT, capture_output=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.decode("utf-8") == r.text + "\n"
    assert b"[stop;" in out.stderr


def test_package_without_tokenizer_serves_ids_and_refuses_text(daemon, tmp_path):
    from workers.model_maker import make_model

    pkg = make_model(str(tmp_path / "ids-only"), vocab=100, golden_cases=1, golden_max_tokens=2)
    d = daemon(backend="ref", chips=1, extra=["--package", pkg])
    with d.client(timeout=60) as c:
        assert c.health()["model"]["text"] is False
        (err,) = raw_events(c, {"text": "hello"})
        assert (err["code"], err["reason"]) == (400, "no_tokenizer") and err["message"].startswith("text:")
        (err,) = raw_events(c, {"prompt": [1, 2], "stop": ["x"]})
        assert (err["code"], err["reason"]) == (400, "no_tokenizer") and "stop" in err["message"]
        evs = raw_events(c, {"prompt": [1, 2], "max_tokens": 4, "ignore_eos": True})
        assert all("text" not in ev for ev in evs) and sum(len(ev["tokens"]) for ev in evs[:-1]) == 4
        r = c.generate([1, 2], max_tokens=4, ignore_eos=True)
        assert r.text is None and len(r.tokens) == 4
