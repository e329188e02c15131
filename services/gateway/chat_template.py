"""Chat messages -> one prompt: the model's chat template, or a documented ChatML-like default.

The model's template is the `chat_template` of its tokenizer_config.json (a Jinja template, as
Hugging Face models ship it), rendered in Jinja's immutable sandbox: a template cannot reach
Python objects beyond the messages and the special tokens it is given. Without one, DEFAULT is
used:

    <bos><|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

and the assistant's turn ends at `<|im_end|>` (a stop token when the vocabulary has it, else a
stop string). The rendered text carries its own special tokens (BOS included), so it is
tokenized without adding any.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidRequest
from services.common.tokenizer import Tokenizer

END_OF_TURN = "<|im_end|>"
DEFAULT = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation and what ends the assistant's turn."""

    text: str
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


class ChatTemplate:
    """Renders OpenAI-style messages with a model's template (or DEFAULT)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        source = _pick(tokenizer.chat_template)
        self.is_default = source is None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        self._template = env.from_string(DEFAULT if source is None else source)
        bos = tokenizer.token(tokenizer.bos_token_id) or ""
        eos_ids = tokenizer.eos_token_ids
        eos = tokenizer.token(eos_ids[0]) if eos_ids else None
        self._specials = {"bos_token": bos, "eos_token": eos or ""}
        if self.is_default:
            end = tokenizer.token_id(END_OF_TURN)
            self._stop_ids = () if end is None else (end,)
            self._stop = (END_OF_TURN,) if end is None else ()
        else:  # the model's own EOS ends its turn (the engine stops there)
            self._stop_ids, self._stop = (), ()

    def render(self, messages: Sequence[dict], extra: dict | None = None) -> ChatPrompt:
        """The prompt for the assistant's next turn. Messages are dicts with a `role` and a
        string `content` (the HTTP layer has checked and flattened them). `extra` are more
        variables for the template (e.g. `add_generation_prompt`, `documents`, a request's
        chat_template_kwargs), as transformers' apply_chat_template passes its kwargs; the
        caller keeps them off `messages` and the special tokens."""
        variables = {"add_generation_prompt": True, **self._specials, **(extra or {})}
        try:
            text = self._template.render(messages=list(messages), **variables)
        except InvalidRequest:
            raise
        except jinja2.TemplateError as e:
            raise InvalidRequest(
                f"the model's chat template cannot render these messages: {e}", param="messages"
            ) from e
        return ChatPrompt(text, self._stop_ids, self._stop)


def _pick(template: object) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named ones ("default")."""
    if isinstance(template, str) and template:
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) and chosen else None
    return None


def _raise(message: str) -> None:
    # Templates call raise_exception() on conversations they do not accept (e.g. roles that
    # do not alternate): that is the caller's input, so a 400 with the template's words.
    raise InvalidRequest(f"the model's chat template refused the messages: {message}", "messages")
