"""Chat templates: the model's own, rendered as transformers renders it, or none (chat refused)."""

from __future__ import annotations

import json
import shutil

import pytest

from services.common.errors import InvalidRequest, ModelLoadError
from services.common.tokenizer import Tokenizer
from services.gateway.chat_template import ChatTemplate

MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]

# Loop controls ({% break %}, {% continue %}), a namespace, tojson of non-ASCII text, trimmed
# blocks, the {% generation %} tag and the special tokens: what Hub templates lean on.
LOOP_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}
        {%- set ns.system = m['content'] %}
        {%- continue %}
    {%- endif %}
    {%- if loop.index > 6 %}{% break %}{% endif %}
<|im_start|>{{ m['role'] }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}
{% else %}{{ m['content'] }}
{% endif %}<|im_end|>
{% endfor %}
{%- if ns.system %}[system {{ ns.system | tojson }}]{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def folder_with(tiny_model, tmp_path, **files: str):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    for name, text in files.items():
        (folder / name.replace("_jinja", ".jinja")).write_text(text)
    return folder


def with_template(tiny_model, tmp_path, template):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return ChatTemplate(Tokenizer.from_dir(folder))


def test_the_embedded_models_template_is_chatml_after_bos(tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    template = ChatTemplate(tokenizer)
    assert template.available
    chat = template.render(MESSAGES)
    assert chat.text == (
        "<|begin_of_text|><|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.stop_token_ids == () and chat.stop == ()  # EOS ids (1 and <|im_end|>) end it
    ids = tokenizer.encode(chat.text, add_special_tokens=False)
    assert ids.count(0) == 1 and ids.count(2) == 3 and ids.count(3) == 2


def test_the_models_template_is_used_with_its_special_tokens(tiny_model, tmp_path):
    template = with_template(
        tiny_model,
        tmp_path,
        "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
    )
    chat = template.render(MESSAGES)
    assert chat.text == (
        "<|begin_of_text|>[SYSTEM] S<|end_of_text|>[USER] U<|end_of_text|>[ASSISTANT]"
    )


def test_rendering_equals_transformers_apply_chat_template(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    folder = folder_with(tiny_model, tmp_path, chat_template_jinja=LOOP_TEMPLATE)
    messages = [
        {"role": "system", "content": "Réponds en français → «court»"},
        {"role": "user", "content": "Bonjour 🙂"},
        {"role": "assistant", "content": "Salut"},
        *[{"role": "user", "content": f"turn {i}"} for i in range(8)],
    ]
    ours = ChatTemplate(Tokenizer.from_dir(folder)).render(messages).text
    reference = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours == reference
    assert "{% break %}" in LOOP_TEMPLATE and ours.count("<|im_start|>user") == 4
    assert '"Réponds en français → «court»"' in ours  # tojson keeps non-ASCII text


def test_a_model_without_a_template_refuses_chat_naming_the_fix(tiny_model, tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate(Tokenizer.from_dir(folder), model=str(folder))
    assert not template.available
    with pytest.raises(InvalidRequest, match="has no chat template") as err:
        template.render(MESSAGES)
    message = str(err.value)
    assert str(folder) in message and "/v1/completions" in message
    assert "--chat-template FILE" in message and err.value.param == "messages"


def test_chat_template_file_replaces_the_folders(tiny_model, tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    template = ChatTemplate.from_file(Tokenizer.from_dir(tiny_model), file)
    assert template.render(MESSAGES).text == "system:S;user:U;"
    file.write_text("{% for m in messages %}")
    with pytest.raises(ModelLoadError, match=r"--chat-template .*t\.jinja is not a valid Jinja"):
        ChatTemplate.from_file(Tokenizer.from_dir(tiny_model), file)
    with pytest.raises(ModelLoadError, match="cannot be read"):
        ChatTemplate.from_file(Tokenizer.from_dir(tiny_model), tmp_path / "missing.jinja")


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


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
    ],
)
def test_a_template_cannot_reach_python_internals(tiny_model, tmp_path, source):
    template = with_template(tiny_model, tmp_path, source)
    with pytest.raises(InvalidRequest, match="cannot render"):
        template.render(MESSAGES)
