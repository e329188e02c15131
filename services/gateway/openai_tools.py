"""The request side of tool calling: which parser reads a chat answer (tool_choice), and an
assistant's tool_calls and a tool message's tool_call_id as the chat template gets them.

openai_protocol.parse calls these; tool_parsers.py reads the answers.
"""

from __future__ import annotations

import json

from services.common.errors import InvalidRequest
from services.common.structured_output import GuideKind, StructuredOutput
from services.gateway.openai_fields import show
from services.gateway.tool_parsers import FirstCall, JsonArrayParser, ToolParser


def tool_choice(
    values: dict, parser: ToolParser | None
) -> tuple[ToolParser | None, StructuredOutput | None]:
    """The parser of the answer and, when a call is forced, the constraint that forces it.

    "auto" (the default when tools are sent): `parser` (the gateway's --tool-call-parser)
    reads the model's own calls; refused without one, as vLLM does. "none": no parser.
    "required" and a named function: the answer is constrained (structured output) to a JSON
    array of calls, `[{"name": ..., "parameters": {...}}, ...]`, each of a tool (of the named
    one) with parameters valid against its schema, and read as such whatever the model's own
    format (as vLLM forces them with its guided decoding). `parallel_tool_calls` (default true)
    lets "required" write one or more calls, false exactly one; a named function is called once.
    Under "auto" false keeps the first call the model wrote (its text is not constrained)."""
    tools = values.get("tools") or []
    choice = values.get("tool_choice", "auto" if tools else "none")
    parallel = values.get("parallel_tool_calls", True)
    names = [_tool_name(i, t) for i, t in enumerate(tools)]
    if choice == "none":
        return None, None
    if not tools:
        raise InvalidRequest(
            f"'tool_choice' = {show(choice)} needs 'tools' to choose from: send tools, or "
            'tool_choice "none"',
            param="tool_choice",
        )
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest(
                '\'tool_choice\' as an object must be {"type": "function", "function": '
                '{"name": ...}}',
                param="tool_choice",
            )
        if name not in names:
            raise InvalidRequest(
                f"'tool_choice' names the function {show(name)}, which is not among the "
                f"tools ({', '.join(names)})",
                param="tool_choice",
            )
        forced = [t for t in tools if t["function"]["name"] == name]
        return JsonArrayParser(), forced_calls(forced, most=1)
    if choice == "required":
        return JsonArrayParser(), forced_calls(tools, most=None if parallel else 1)
    if choice != "auto":
        raise InvalidRequest(
            f'\'tool_choice\' must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {show(choice)}',
            param="tool_choice",
        )
    if parser is None:
        raise InvalidRequest(
            "'tools' with tool_choice \"auto\" needs a tool-call parser to read the model's "
            "calls, and this gateway has none: start it with --tool-call-parser NAME (hermes, "
            'llama3_json), or send tool_choice "none" (the tools reach the chat template, '
            "the answer stays text)",
            param="tools",
        )
    return (parser if parallel else FirstCall(parser)), None


def forced_calls(tools: list[dict], most: int | None) -> StructuredOutput:
    """The constraint of an answer that is a JSON array of one to `most` (None: any number)
    calls, each of one of `tools` (JsonArrayParser reads it)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if most is not None:
        schema["maxItems"] = most
    return StructuredOutput(GuideKind.JSON, json.dumps(schema), any_whitespace=False)


def _tool_name(i: int, tool: object) -> str:
    """A tool's function name, the tool checked: OpenAI's function tool shape."""
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if function is None or tool.get("type") != "function" or not isinstance(name, str) or not name:
        raise InvalidRequest(
            f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
            '"parameters": {...}}} (only function tools exist)',
            param="tools",
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(
            f"tools[{i}].function.parameters must be a JSON schema object", param="tools"
        )
    return name


def tool_fields(i: int, m: dict) -> dict:
    """An assistant message's `tool_calls` (their arguments as objects, as chat templates
    read them and as vLLM passes them) or a tool message's `tool_call_id`."""
    out: dict = {}
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        if not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls must be an array", param="messages")
        out["tool_calls"] = [_template_call(f"messages[{i}].tool_calls[{j}]", c)
                             for j, c in enumerate(calls)]  # fmt: skip
    call_id = m.get("tool_call_id")
    if m["role"] == "tool" and call_id is not None:
        if not isinstance(call_id, str):
            raise InvalidRequest(
                f"messages[{i}].tool_call_id must be a string, got {show(call_id)}",
                param="messages",
            )
        out["tool_call_id"] = call_id
    return out


def _template_call(where: str, call: object) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or call.get("type", "function") != "function":
        raise InvalidRequest(
            f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
            '"arguments": "<JSON>"}}',
            param="messages",
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(
            f"{where}.function.arguments must be a JSON object written as a string",
            param="messages",
        )
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
