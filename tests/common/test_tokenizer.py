"""Tokenizer and streaming detokenization."""

from __future__ import annotations

from services.common.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Hello wörld, café 東京 🙂 déjà vu → done"


def stream(tok: Tokenizer, ids: list[int], prompt: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_bpe_round_trip_and_bos(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids) == TEXT
    assert tok.eos_token_ids == (1,)


def test_streaming_never_splits_a_character(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    prompt = tok.encode("Say:")
    ids = tok.encode(TEXT)[1:]
    # Emoji and CJK characters span several byte-level tokens here.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream(tok, ids, prompt)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_byte_level_fallback_without_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text('{"eos_token_id": 257, "bos_token_id": 256}')
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.is_byte_level_fallback
    ids = tok.encode(TEXT)
    assert ids[0] == 256 and ids[1:] == list(TEXT.encode())
    assert tok.decode(ids) == TEXT
    deltas = stream(tok, ids[1:], [])
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_flush_emits_an_incomplete_character_at_the_end(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    tok = Tokenizer.from_dir(tmp_path)
    detok = IncrementalDetokenizer(tok)
    assert detok.add(list(b"ab")) == "ab"
    assert detok.add(list("é".encode())[:1]) == ""  # half of é: held back
    assert detok.flush() == "\ufffd"
