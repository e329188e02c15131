"""Chat templates: the model's own (sandboxed) or the documented ChatML-like default."""

from __future__ import annotations

import json
import shutil

import pytest

from services.common.errors import InvalidRequest
from services.common.tokenizer import Tokenizer
from services.gateway.chat_template import ChatTemplate

MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def with_template(tiny_model, tmp_path, template):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return ChatTemplate(Tokenizer.from_dir(folder))


def test_the_default_template_is_chatml_with_bos_and_stops_at_im_end(tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    template = ChatTemplate(tokenizer)
    assert template.is_default
    chat = template.render(MESSAGES)
    assert chat.text == (
        "<|begin_of_text|><|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.stop_token_ids == (tokenizer.token_id("<|im_end|>"),) == (3,)
    ids = tokenizer.encode(chat.text, add_special_tokens=False)
    assert ids.count(0) == 1 and ids.count(2) == 3 and ids.count(3) == 2


def test_the_models_template_is_used_with_its_special_tokens(tiny_model, tmp_path):
    template = with_template(
        tiny_model,
        tmp_path,
        "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
    )
    assert not template.is_default
    chat = template.render(MESSAGES)
    assert chat.text == (
        "<|begin_of_text|>[SYSTEM] S<|end_of_text|>[USER] U<|end_of_text|>[ASSISTANT]"
    )
    assert chat.stop_token_ids == () and chat.stop == ()  # the model's EOS ends its turn


def test_a_template_that_refuses_the_conversation_is_a_400(tiny_model, tmp_path):
    template = with_template(
        tiny_model,
        tmp_path,
        "{% if messages[0].role != 'user' %}{{ raise_exception('start with a user turn') }}"
        "{% endif %}ok",
    )
    with pytest.raises(InvalidRequest, match="start with a user turn") as err:
        template.render(MESSAGES)
    assert err.value.param == "messages"


def test_a_template_cannot_reach_python_internals(tiny_model, tmp_path):
    template = with_template(
        tiny_model, tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(InvalidRequest, match="cannot render"):
        template.render(MESSAGES)
