"""A chat request, whichever API it came in: messages checked and rendered with the chat
template, the tools' parser and the constraint a forced call needs.

Both public APIs call `chat_call` with the same dict (the HTTP body's checked fields; the gRPC
servicer writes a `Chat` message as that dict), so a conversation is checked, rendered and
read back identically on both by construction: the same prompt tokens, the same tool calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams
from services.common.structured_output import StructuredOutput
from services.gateway.chat_template import ROLES, ChatPrompt
from services.gateway.openai_fields import show
from services.gateway.openai_tools import tool_choice, tool_fields
from services.gateway.tool_parsers import ToolParser

# Variables the chat template gets from the request's own fields or the tokenizer: never from
# chat_template_kwargs (value: where they come from).
TEMPLATE_OWN = {
    "messages": "the request's messages",
    "add_generation_prompt": "the request's add_generation_prompt",
    "continue_final_message": "the request's continue_final_message",
    "documents": "the request's documents",
    "tools": "the request's tools",
    "bos_token": "the model's tokenizer",
    "eos_token": "the model's tokenizer",
    "raise_exception": "the server",
    "strftime_now": "the server",
}
# render_chat(messages, variables) -> ChatPrompt: the chat template (chat_template.py).
RenderChat = Callable[[Sequence[dict], dict], ChatPrompt]


@dataclass(frozen=True)
class ChatCall:
    """A checked conversation: its rendered prompt, its messages (flattened as the template got
    them), the parser that reads the answer's tool calls (None: the answer is text) and the
    constraint forcing a call (tool_choice "required" or a function; None: not forced)."""

    prompt: ChatPrompt
    messages: list[dict]
    tool_parser: ToolParser | None
    forced: StructuredOutput | None
    tool_choice: object = None  # as sent, for messages

    def applied(self, params: SamplingParams) -> SamplingParams:
        """`params` with what the chat adds: the template's stop strings and ids, and the
        forced call's constraint (InvalidRequest when `params` carries a constraint of its
        own: an answer cannot be a tool call and follow another grammar)."""
        structured = params.structured_output
        if self.forced is not None and structured is not None:
            raise InvalidRequest(
                f"'tool_choice' = {show(self.tool_choice)} constrains the answer to tool "
                "calls, and so it cannot also follow response_format or another structured "
                "output constraint: send one",
                param="tool_choice",
            )
        return dataclasses.replace(
            params,
            stop=(*params.stop, *self.prompt.stop),
            stop_token_ids=(*params.stop_token_ids, *self.prompt.stop_token_ids),
            structured_output=self.forced or structured,
        )


def chat_call(values: dict, render_chat: RenderChat, tool_parser: ToolParser | None) -> ChatCall:
    """Check and render a chat request's `values` (messages, tools, tool_choice,
    parallel_tool_calls, chat_template_kwargs, add_generation_prompt,
    continue_final_message, documents; as the HTTP body names them). `tool_parser` is the
    gateway's --tool-call-parser. InvalidRequest, naming the field, for anything off."""
    parser, forced = tool_choice(values, tool_parser)
    messages = chat_messages(values["messages"])
    return ChatCall(
        render(values, messages, render_chat), messages, parser, forced, values.get("tool_choice")
    )


def render(values: dict, messages: list[dict], render_chat: RenderChat) -> ChatPrompt:
    """The chat prompt of checked `values`: the template gets add_generation_prompt, documents
    and chat_template_kwargs as variables; continue_final_message cuts the text after the last
    message's content, as transformers' apply_chat_template does."""
    variables = dict(_template_kwargs(values.get("chat_template_kwargs", {})))
    cont = values.get("continue_final_message", False)
    generation = values.get("add_generation_prompt", not cont)
    if cont and generation:
        raise InvalidRequest(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: "
            "continuing the last message opens no new turn",
            param="continue_final_message",
        )
    variables["add_generation_prompt"] = generation
    if "documents" in values:
        variables["documents"] = values["documents"]
    if values.get("tools"):  # as transformers' apply_chat_template(tools=...) passes them
        variables["tools"] = values["tools"]
    chat = render_chat(messages, variables)
    if not cont:
        return chat
    final = messages[-1]["content"].strip()
    if not final or final not in chat.text:
        raise InvalidRequest(
            "'continue_final_message' needs a last message whose content the chat template "
            "writes out; this one is empty or the template does not show it",
            param="continue_final_message",
        )
    return dataclasses.replace(chat, text=chat.text[: chat.text.rindex(final) + len(final)])


def _template_kwargs(kwargs: dict) -> dict:
    for name in kwargs:
        if name in TEMPLATE_OWN:
            raise InvalidRequest(
                f"chat_template_kwargs may not set '{name}': the template gets it from "
                f"{TEMPLATE_OWN[name]}",
                param="chat_template_kwargs",
            )
    return kwargs


def chat_messages(messages: list) -> list[dict]:
    """Messages with a known role and text content, flattened to strings for the template."""
    if not messages:
        raise InvalidRequest("'messages' is empty: give at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidRequest(
                f"messages[{i}] must be an object with a role among {', '.join(ROLES)}",
                param="messages",
            )
        message = {"role": m["role"], "content": _content(i, m.get("content"))}
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(
                f"messages[{i}].name must be a string, got {show(name)}", param="messages"
            )
        if name is not None:
            message["name"] = name
        message.update(tool_fields(i, m))
        for key, value in m.items():
            if key not in ("role", "content", "name", *message) and value not in (
                None,
                [],
                {},
                "",
            ):
                raise InvalidRequest(
                    f"messages[{i}].{key} is not supported: this server gives the chat template "
                    "a message's role, content and name, an assistant's tool_calls and a tool "
                    "message's tool_call_id",
                    param="messages",
                )
        out.append(message)
    return out


def _content(i: int, content: object) -> str:
    """A message's content as one string: text parts joined by newlines, null as empty."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise InvalidRequest(
                    f"messages[{i}].content: only text parts "
                    '({"type": "text", "text": ...}) are supported',
                    param="messages",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InvalidRequest(
            f"messages[{i}].content must be a string or an array of text parts",
            param="messages",
        )
    return content
