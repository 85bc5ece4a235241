"""Package tokenizers: byte-level, older manifests, kind `none`, and the lazily imported GGUF tokenizer."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from workers.model_maker import make_model
from workers.package_loader import load_package
from workers.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer, tokenizer_spec


@dataclass
class Pkg:
    path: str
    manifest: dict


def test_byte_tokenizer_encodes_utf8_and_pieces_are_bytes():
    tok = ByteTokenizer(320)
    assert tok.encode("hé") == [104, 195, 169]
    assert b"".join(tok.piece(t) for t in tok.encode("hé€")) == "hé€".encode()
    assert tok.piece(256) == tok.piece(319) == b""  # BOS/EOS/PAD and the rest carry no text
    assert ByteTokenizer(320, bos_id=256).encode("a") == [256, 97]
    with pytest.raises(TokenizerError):
        ByteTokenizer(100)


def test_made_model_declares_its_tokenizer_kind(tmp_path):
    big = load_package(make_model(str(tmp_path / "big"), vocab=320, layers=1, d_model=16, heads=2, kv_heads=1,
                                  golden_cases=1, golden_max_tokens=2, max_seq=64, kv_num_blocks=8))
    assert big.manifest["tokenizer"] == {"kind": "bytes"}
    tok = load_tokenizer(big)
    assert isinstance(tok, ByteTokenizer) and tok.encode("ab") == [97, 98]  # no BOS unless the manifest says so
    small = load_package(make_model(str(tmp_path / "small"), vocab=100, layers=1, d_model=16, heads=2, kv_heads=1,
                                    golden_cases=1, golden_max_tokens=2, max_seq=64, kv_num_blocks=8))
    assert small.manifest["tokenizer"] == {"kind": "none"}
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(small)


def test_older_manifests_keep_loading():
    assert tokenizer_spec({"vocab_size": 320, "tokenizer": "bytes"}) == {"kind": "bytes"}
    assert tokenizer_spec({"vocab_size": 320}) == {"kind": "bytes"}  # no kind means bytes
    assert tokenizer_spec({"vocab_size": 100, "tokenizer": "none"}) == {"kind": "none"}
    assert isinstance(load_tokenizer(Pkg("/p", {"vocab_size": 320, "bos_id": 256})), ByteTokenizer)
    with_bos = load_tokenizer(Pkg("/p", {"vocab_size": 320, "bos_id": 256,
                                         "tokenizer": {"kind": "bytes", "add_bos": True}}))
    assert with_bos.encode("a") == [256, 97]
    for bad in ({"kind": "sentencepiece"}, 7, {"no": "kind"}):
        with pytest.raises(TokenizerError, match="kind must be one of"):
            tokenizer_spec({"vocab_size": 320, "tokenizer": bad})


def test_gguf_kind_imports_llamacpp_tokenizer_lazily_with_the_package_file(monkeypatch):
    made: list[str] = []

    class FakeGguf:
        vocab_size = 1000

        def __init__(self, path: str) -> None:
            made.append(path)

    mod = types.ModuleType("workers.llamacpp.tokenizer")
    mod.GgufTokenizer = FakeGguf
    monkeypatch.setitem(sys.modules, "workers.llamacpp", types.ModuleType("workers.llamacpp"))
    monkeypatch.setitem(sys.modules, "workers.llamacpp.tokenizer", mod)
    files = {"model.gguf": "0" * 64, "golden.json": "1" * 64}
    assert isinstance(load_tokenizer(Pkg("/pkgs/g", {"tokenizer": {"kind": "gguf"}, "files": files})), FakeGguf)
    load_tokenizer(Pkg("/pkgs/g", {"tokenizer": {"kind": "gguf", "file": "other.gguf"}, "files": files}))
    assert made == ["/pkgs/g/model.gguf", "/pkgs/g/other.gguf"]
    with pytest.raises(TokenizerError, match="exactly one .gguf"):
        load_tokenizer(Pkg("/pkgs/g", {"tokenizer": {"kind": "gguf"}, "files": {"a.gguf": "", "b.gguf": ""}}))
    with pytest.raises(TokenizerError, match="file name"):
        load_tokenizer(Pkg("/pkgs/g", {"tokenizer": {"kind": "gguf", "file": "../x.gguf"}, "files": files}))


def test_gguf_kind_without_the_llamacpp_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "workers.llamacpp.tokenizer", None)  # import fails
    with pytest.raises(TokenizerError, match=r"pip install -e '\.\[llamacpp\]'"):
        load_tokenizer(Pkg("/pkgs/g", {"tokenizer": {"kind": "gguf"}, "files": {"m.gguf": ""}}))
