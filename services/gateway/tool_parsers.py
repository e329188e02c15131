"""Tool-call parsers: a model's text -> the answer's content and its `tool_calls`.

A model trained for tool use writes its calls in its own format; the operator names the format
with `--tool-call-parser NAME` (as vLLM's flag of that name):

- `hermes` (Hermes 2 Pro, Qwen2.5/Qwen3): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the tags is the answer's content.
- `llama3_json` (Llama 3.1/3.2 JSON tool calling): the whole answer is one or more
  `{"name": ..., "parameters": {...}}` objects (`arguments` is taken too) separated by `;`,
  optionally after `<|python_tag|>`; an answer not starting with `{` is plain content.

One function reads both a finished text and a text still growing (`Parsed` of the text so far,
`final=False`): what it reports for a growing text only grows (content held back while it may
still turn into a call tag; a call's arguments as the raw JSON text written so far), so the
streamed deltas are differences between two parses, and the streamed reply adds up to the whole
one by construction. A call's `arguments` is its JSON object exactly as the model wrote it.

A call that cannot be read (bad JSON, no name, arguments not an object, cut off by max_tokens)
makes the whole text plain content, as vLLM does: the finish reason stays the engine's.

Beside the formats an operator names: `JsonArrayParser` reads the format a forced call is
constrained to (openai_tools.py: tool_choice "required" or a function), and `FirstCall` keeps a
parser's first call (parallel_tool_calls false). Two streams send a parse as it grows: the HTTP
API's deltas (`ToolCallStream`) and the gRPC API's whole calls (`WholeCallStream`).

Why one file over ~300 lines: it is one idea, reading calls out of a model's text, whole and
while it grows; the streams are differences between two parses of the parsers above.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass

from services.common.errors import FailedPrecondition

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is the raw text of its JSON object (None: not started yet);
    `complete` once the object is closed."""

    name: str | None
    arguments: str | None
    complete: bool


@dataclass(frozen=True)
class Parsed:
    """A model's text read by a parser: the content outside the calls and the calls.
    `malformed`: a call could not be read (final parse only): the caller then returns the
    whole text as content."""

    content: str
    calls: tuple[ToolCall, ...]
    malformed: bool = False


class ToolParser:
    """A tool-call format. `parse(text, final)` is the only entry point."""

    name: str = ""

    def parse(self, text: str, final: bool = True) -> Parsed:
        raise NotImplementedError


def new_call_id() -> str:
    """An id for a tool call, unguessable and unique (OpenAI's `call_` prefix)."""
    return "call_" + secrets.token_hex(12)


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text outside the tags."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                rest = text[pos:]
                if calls:
                    rest = rest.lstrip(_WHITESPACE)
                if not final:  # hold back what may yet become a tag, or whitespace before one
                    rest = rest[: len(rest) - _tag_prefix(rest, self.START)]
                    rest = rest.rstrip(_WHITESPACE)
                content.append(rest)
                break
            before = text[pos:start]
            content.append(before.strip(_WHITESPACE) if calls else before.rstrip(_WHITESPACE))
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            call, tail = _read_call(body, ("arguments",))
            if final and (call is None or not call.complete or tail.strip(_WHITESPACE)):
                return Parsed(text, (), malformed=True)
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            pos = end + len(self.END)
        return Parsed("".join(content), tuple(calls))


class Llama3JsonParser(ToolParser):
    """`{"name": ..., "parameters": {...}}` objects separated by `;` (after an optional
    `<|python_tag|>`): the whole answer is calls, or it is plain content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        body = text.lstrip(_WHITESPACE)
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip(_WHITESPACE)
        elif not final and _tag_prefix(body, self.TAG) == len(body):
            return Parsed("", ())  # not yet known whether this is a call
        if not final and not body:
            return Parsed("", ())
        if not body.startswith("{"):
            return Parsed(text, ())
        calls: list[ToolCall] = []
        while True:
            call, tail = _read_call(body, ("parameters", "arguments"))
            if final and (call is None or not call.complete):
                return Parsed(text, (), malformed=True)
            if call is not None:
                calls.append(call)
            if call is None or not call.complete:
                break
            tail = tail.lstrip(_WHITESPACE)
            if not tail:
                break
            if not tail.startswith(";"):
                if final:
                    return Parsed(text, (), malformed=True)
                break
            body = tail[1:].lstrip(_WHITESPACE)
            if not body:
                if final:
                    return Parsed(text, (), malformed=True)
                break
        return Parsed("", tuple(calls))


class JsonArrayParser(ToolParser):
    """A JSON array of `{"name": ..., "parameters": {...}}` objects: the answer a forced tool
    call is constrained to (openai_tools.forced_calls), read whatever the model's own format.
    Text not starting with `[` is plain content."""

    name = "json_array"

    def parse(self, text: str, final: bool = True) -> Parsed:
        body = text.lstrip(_WHITESPACE)
        if not body:
            return Parsed("", (), malformed=final)
        if not body.startswith("["):
            return Parsed(text, ())
        calls: list[ToolCall] = []
        body = body[1:]
        while True:
            call, tail = _read_call(body, ("parameters", "arguments"))
            if call is None or not call.complete:
                if final:
                    return Parsed(text, (), malformed=True)
                calls.extend([call] if call else [])
                break
            calls.append(call)
            tail = tail.lstrip(_WHITESPACE)
            if tail.startswith("]"):
                if final and tail[1:].strip(_WHITESPACE):
                    return Parsed(text, (), malformed=True)
                break
            if not tail.startswith(","):
                if final:
                    return Parsed(text, (), malformed=True)
                break
            body = tail[1:]
        return Parsed("", tuple(calls))


class FirstCall(ToolParser):
    """Another parser's reading, keeping its first call only: parallel_tool_calls false where
    the answer is not constrained (tool_choice "auto"), as vLLM keeps the first."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.name = parser.name

    def parse(self, text: str, final: bool = True) -> Parsed:
        parsed = self.parser.parse(text, final)
        return dataclasses.replace(parsed, calls=parsed.calls[:1])


class MalformedToolCall(FailedPrecondition):
    """A streamed call whose start was already sent turned out unreadable at its end: too
    late to send the text as content instead, so the stream ends with this error."""


class ToolCallStream:
    """Streams one answer's text as content and tool-call deltas (OpenAI's `delta.tool_calls`:
    `index`, `id`, `type` and the function's name once, then `arguments` in pieces): each
    `feed` parses the text so far and sends what grew since the last parse."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []  # of the calls whose header was sent
        self.arguments_sent: list[int] = []

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) after `delta` of the model's text."""
        self.text += delta
        return self._send(self.parser.parse(self.text, final=False))

    def finish(self, delta: str = "") -> tuple[str, list[dict], bool]:
        """The rest of the answer once the model stopped with `delta`: (content, deltas,
        whether it called tools). An unreadable call whose header went out raises
        MalformedToolCall."""
        self.text += delta
        parsed = self.parser.parse(self.text, final=True)
        if parsed.malformed:
            if self.ids:
                raise MalformedToolCall(
                    f"the model's tool call could not be read by the '{self.parser.name}' "
                    "parser (invalid JSON, no name, or cut off by max_tokens); the streamed "
                    "tool call is incomplete"
                )
            return self.text[self.content_sent :], [], False
        content, deltas = self._send(parsed)
        return content, deltas, bool(parsed.calls)

    def _content(self, parsed: Parsed) -> str:
        """The content the parse adds to what was sent."""
        content = parsed.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parsed.content))
        return content

    def _send(self, parsed: Parsed) -> tuple[str, list[dict]]:
        content = self._content(parsed)
        deltas = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            arguments = call.arguments or ""
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.arguments_sent.append(len(arguments))
                function = {"name": call.name, "arguments": arguments}
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": function})  # fmt: skip
            elif len(arguments) > self.arguments_sent[i]:
                piece = arguments[self.arguments_sent[i] :]
                self.arguments_sent[i] = len(arguments)
                deltas.append({"index": i, "function": {"arguments": piece}})
        return content, deltas


class WholeCallStream(ToolCallStream):
    """Streams one answer's text as content and whole calls (the gRPC API's `tool_calls`):
    each call once, `{"id", "name", "arguments"}`, on the feed whose text closed its JSON
    object. `feed` and `finish` are ToolCallStream's; their second item is these calls."""

    def _send(self, parsed: Parsed) -> tuple[str, list[dict]]:
        content = self._content(parsed)
        calls = []
        for call in parsed.calls[len(self.ids) :]:
            if not call.complete:
                break
            self.ids.append(new_call_id())
            calls.append({"id": self.ids[-1], "name": call.name, "arguments": call.arguments})
        return content, calls


def tool_calls(parsed: Parsed) -> list[dict]:
    """A whole reply's `message.tool_calls`."""
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in parsed.calls
    ]


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError naming the choices for another name."""
    if name not in PARSERS:
        raise ValueError(
            f"no tool-call parser {name!r}: choose one of {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]()


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag maybe still arriving)."""
    for n in range(min(len(tag), len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _read_call(text: str, argument_keys: tuple[str, ...]) -> tuple[ToolCall | None, str]:
    """A call object at the start of `text` (whitespace first allowed), read as far as it
    goes: (the call, the text after its closing brace), or (None, "") when not even its
    name is readable yet or ever. Keys are read one by one with the JSON decoder, so a
    value's exact source text is known: the arguments are streamed as written."""
    i = _skip(text, 0)
    if i == len(text) or text[i] != "{":
        return None, ""
    i += 1
    name: str | None = None
    arguments: str | None = None
    first = True
    while True:
        i = _skip(text, i)
        if i == len(text):
            break
        if text[i] == "}":
            if name is None or arguments is None:
                return None, ""
            return ToolCall(name, arguments, complete=True), text[i + 1 :]
        if not first:
            if text[i] != ",":
                return None, ""
            i = _skip(text, i + 1)
        try:
            key, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        i = _skip(text, i)
        if i == len(text):
            break
        if text[i] != ":" or not isinstance(key, str):
            return None, ""
        i = _skip(text, i + 1)
        if i == len(text):
            break
        if key in argument_keys:
            if text[i] != "{":
                return None, ""
            try:
                _, end = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:
                arguments = text[i:]  # still being written: everything so far is inside it
                break
            arguments = text[i:end]
            i = end
        else:
            try:
                value, i = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:
                break
            if key == "name":
                if not isinstance(value, str) or not value:
                    return None, ""
                name = value
        first = False
    if name is None:
        return None, ""
    return ToolCall(name, arguments, complete=False), ""


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i
