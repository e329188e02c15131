"""Chat messages -> one prompt, rendered with the model's own chat template.

The template is the one the model folder ships (`chat_template.jinja`, else tokenizer_config.json's
`chat_template`; services/common/tokenizer.py reads them), or a file the operator names with
`--chat-template`. It is rendered the way transformers' `apply_chat_template` renders it, so a
prompt here is the prompt transformers would build: Jinja's immutable sandbox (a template cannot
reach Python objects beyond what it is given) with trim_blocks and lstrip_blocks, the
`loopcontrols` extension ({% break %}, {% continue %}), the `{% generation %}` tag, and the helpers
transformers defines (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, a
`namespace` that refuses underscore names). The special tokens of tokenizer_config.json are
passed by name (bos_token, eos_token ...). The rendered text carries its own special tokens, so
it is tokenized without adding any; the model's EOS ids end the assistant's turn.

A model without a template cannot chat: inventing one would prompt it in a format it was never
trained on, so chat is refused (a 400 naming the fix) while /v1/completions keeps working.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidRequest, ModelLoadError
from services.common.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation and what ends the assistant's turn."""

    text: str
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


class ChatTemplate:
    """Renders OpenAI-style messages with a model's chat template.

    `source` overrides the folder's template (`--chat-template FILE`; `origin` names it in
    errors); `model` names the folder in errors. Without either template, `available` is False
    and render refuses with a message saying what to do. A template Jinja cannot compile is a
    ModelLoadError at start.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        source: str | None = None,
        *,
        model: str = "",
        origin: str = "--chat-template",
    ) -> None:
        if source is None:
            origin = f"the chat template of {model or 'the model folder'}"
        source = source if source is not None else tokenizer.chat_template
        self.available = source is not None
        self._model = model
        try:
            self._template = None if source is None else _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"{origin} is not a valid Jinja template: {e}") from e
        self._specials = dict(tokenizer.special_tokens)

    @classmethod
    def from_file(cls, tokenizer: Tokenizer, file: Path | None, *, model: str = "") -> ChatTemplate:
        """The folder's template, or the one in `file` (read and compiled now, so a bad file
        stops the gateway at start rather than failing every chat request)."""
        if file is None:
            return cls(tokenizer, model=model)
        try:
            source = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"--chat-template {file} cannot be read: {e}") from e
        return cls(tokenizer, source, model=model, origin=f"--chat-template {file}")

    def render(self, messages: Sequence[dict], extra: dict | None = None) -> ChatPrompt:
        """The prompt for the assistant's next turn. Messages are dicts with a `role` and a
        string `content` (the HTTP layer has checked and flattened them). `extra` are more
        variables for the template (e.g. `add_generation_prompt`, `documents`, a request's
        chat_template_kwargs), as transformers' apply_chat_template passes its kwargs; the
        caller keeps them off `messages` and the special tokens."""
        if self._template is None:
            where = f"the model folder {self._model}" if self._model else "the model folder"
            raise InvalidRequest(
                f"this model cannot chat: {where} has no chat template (no chat_template.jinja, "
                "no chat_template in tokenizer_config.json). Use /v1/completions with a prompt "
                "you format yourself, or start the gateway with --chat-template FILE",
                param="messages",
            )
        variables = {
            "tools": None,
            "documents": None,
            "add_generation_prompt": True,
            **self._specials,
            **(extra or {}),
        }
        try:
            text = self._template.render(messages=list(messages), **variables)
        except InvalidRequest:
            raise
        except jinja2.TemplateError as e:
            raise InvalidRequest(
                f"the model's chat template cannot render these messages: {e}", param="messages"
            ) from e
        return ChatPrompt(text)


def _environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment of transformers' chat templates (chat_template_utils)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with
    it (for training masks); rendering a prompt only needs its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without the attributes of the dict type itself."""

    def __call__(self, *args: object, **kwargs: object) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: object, **kwargs: object) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no reach into CPython internals)."""

    def __init__(*args: object, **kwargs: object) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store the underscore name {name!r} on a namespace"
            )


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    # Templates call raise_exception() on conversations they do not accept (e.g. roles that
    # do not alternate): that is the caller's input, so a 400 with the template's words.
    raise InvalidRequest(f"the model's chat template refused the messages: {message}", "messages")
