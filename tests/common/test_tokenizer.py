"""Tokenizer and streaming detokenization."""

from __future__ import annotations

import json
import shutil

import pytest

from services.common.errors import ModelLoadError
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
    assert tok.eos_token_ids == (1, 3)


def test_streaming_never_splits_a_character(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    prompt = tok.encode("Say:")
    ids = tok.encode(TEXT)[1:]
    # Emoji and CJK characters span several byte-level tokens here.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream(tok, ids, prompt)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_flush_emits_an_incomplete_character_at_the_end(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    ids = tok.encode("ab🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    head = next(i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[: i + 1]))
    assert "".join(detok.add([i]) for i in ids[: head + 1]) == "ab"  # half of 🙂: held back
    assert detok.flush() == "\ufffd"


def test_the_embedded_models_end_a_chat_turn_at_im_end(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    assert tok.eos_token_ids == (1, 3) and tok.token(3) == "<|im_end|>"
    assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


def test_a_folder_without_tokenizer_json_is_refused_naming_what_it_holds(tiny_model, tmp_path):
    folder = tmp_path / "slow"
    shutil.copytree(tiny_model, folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(ModelLoadError, match=r"has no tokenizer\.json") as err:
        Tokenizer.from_dir(folder)
    assert "tokenizer.model" in str(err.value) and "save_pretrained" in str(err.value)


def test_an_unreadable_tokenizer_json_is_refused(tiny_model, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(tiny_model, folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json cannot be read"):
        Tokenizer.from_dir(folder)


def test_chat_template_jinja_is_read_before_tokenizer_configs(tiny_model, tmp_path):
    folder = tmp_path / "jinja"
    shutil.copytree(tiny_model, folder)
    assert Tokenizer.from_dir(folder).chat_template.startswith("{{ bos_token }}")
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert Tokenizer.from_dir(folder).chat_template == "{{ messages[0].content }}"


def test_a_named_template_list_uses_the_default_one(tiny_model, tmp_path):
    folder = tmp_path / "named"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    config["bos_token"] = {"content": "<|begin_of_text|>", "__type": "AddedToken"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(folder)
    assert tok.chat_template == "D"
    assert tok.special_tokens["bos_token"] == "<|begin_of_text|>"
