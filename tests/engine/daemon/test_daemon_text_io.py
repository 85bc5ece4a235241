"""Which tokenizer the daemon serves: the package's, the built-in byte layout, or none."""

from __future__ import annotations

import json

import pytest

from engine.daemon.text_io import TextRejected, prompt_of, served_tokenizer, split_stop
from workers.backends.base import BackendInfo, KvLayout
from workers.model_maker import make_model
from workers.tokenizer import ByteTokenizer, TokenizerError


def _info(vocab: int, **extra) -> BackendInfo:
    return BackendInfo(name="x", vocab_size=vocab, eos_ids=(1,), max_seq=64, profiles=(),
                       kv=KvLayout(block_size=16, num_blocks=4), extra=extra)


def test_the_daemon_serves_the_tokenizer_of_the_package_the_workers_loaded(tmp_path):
    # no package (stub, sim): the built-in byte-level layout when the vocabulary has room for it
    assert isinstance(served_tokenizer(None, _info(320)), ByteTokenizer)
    assert served_tokenizer(None, _info(100)) is None
    small = make_model(str(tmp_path / "small"), vocab=100, layers=1, d_model=16, heads=2, kv_heads=1,
                       golden_cases=1, golden_max_tokens=2, max_seq=64, kv_num_blocks=8)
    assert served_tokenizer(None, _info(100, package=small)) is None  # the package says "none"
    big = make_model(str(tmp_path / "big"), vocab=320, layers=1, d_model=16, heads=2, kv_heads=1,
                     golden_cases=1, golden_max_tokens=2, max_seq=64, kv_num_blocks=8)
    assert isinstance(served_tokenizer(big, _info(320)), ByteTokenizer)
    # a manifest naming a tokenizer the package cannot provide stops the daemon's start-up with the reason
    m = json.loads((tmp_path / "big" / "manifest.json").read_text())
    m["tokenizer"] = {"kind": "gguf"}
    (tmp_path / "big" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TokenizerError, match="exactly one .gguf"):
        served_tokenizer(big, _info(320))


def test_prompt_of_text_and_split_stops():
    tok = ByteTokenizer(320)
    assert prompt_of({"prompt": [5, 6]}, None) == [5, 6]
    assert prompt_of({"text": "hé"}, tok) == [104, 195, 169]
    with pytest.raises(TextRejected) as info:
        prompt_of({"text": "x"}, None)
    assert info.value.reason == "no_tokenizer"
    with pytest.raises(TextRejected) as info:
        prompt_of({"text": ""}, tok)
    assert info.value.reason == "out_of_range" and info.value.message.startswith("text:")
    assert split_stop(["a", [1, 2], "b", [3]]) == ([[1, 2], [3]], ["a", "b"])
