"""gRPC servicers of the gateway: the public Generate API and its view of the workers.

A `chat` prompt is written here as the HTTP chat body names its fields and checked, rendered
and read back by the same code as the HTTP API's (chat_request.py, tool_parsers.py): protobuf
stops here, the conversation is one thing whichever API it came in.
"""

from __future__ import annotations

import contextlib
import json

from services.common import clock, telemetry
from services.common.convert import finish_to_pb, logprobs_list_to_pb
from services.common.discovery import ROLE_VALUES
from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
)
from services.common.generation_defaults import GenerationDefaults
from services.common.tokenizer import Tokenizer
from services.gateway.chat_request import ChatCall, chat_call
from services.gateway.chat_template import ChatTemplate
from services.gateway.events import Done
from services.gateway.openai_protocol import check_unicode
from services.gateway.registry import Registry
from services.gateway.request import Limits, validate
from services.gateway.router import Router
from services.gateway.tool_parsers import ToolParser, WholeCallStream

# Initial metadata of a Generate call on an emulated mesh: wall seconds per emulated second.
TIME_SCALE_HEADER = "x-distserve-time-scale"
TOOL_CHOICE_MODES = ("none", "auto", "required")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        limits: Limits,
        defaults: GenerationDefaults | None = None,
        chat_template: ChatTemplate | None = None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.limits = limits
        self.defaults = defaults  # generation_config.json's, for fields a request leaves unset
        self.chat_template = chat_template or ChatTemplate(tokenizer)  # the HTTP API's
        self.tool_parser = tool_parser  # --tool-call-parser: reads tool_choice "auto" answers

    async def Generate(self, request, context):
        received = clock.monotonic()
        # Behind Envoy, its x-request-id names the request (as in its access log).
        edge_id = dict(context.invocation_metadata() or ()).get("x-request-id", "")
        chat = self._chat(request.chat) if request.WhichOneof("prompt") == "chat" else None
        req = await validate(
            request,
            self.tokenizer,
            self.limits,
            context.time_remaining(),
            edge_id,
            self.defaults,
            chat,
        )
        if clock.scale() != 1.0:  # an emulated mesh: the client reports latencies in its time
            await context.send_initial_metadata(((TIME_SCALE_HEADER, repr(clock.scale())),))
        completion = ended = 0
        parser = chat and chat.tool_parser
        calls_of: dict[int, WholeCallStream] = {}  # each choice's answer read by the parser
        events = self.router.generate(req, telemetry.incoming(context), received=received)
        async with contextlib.aclosing(events):  # closed here, also when a reply fails
            async for out in events:
                completion += len(out.token_ids)
                reason = out.reason if isinstance(out, Done) else None
                tools = calls_of.get(out.index)
                if tools is None and parser is not None:  # this choice's first response
                    tools = calls_of[out.index] = WholeCallStream(parser)
                text, calls = _answer(tools, out.text, reason is not None)
                reply = gateway_pb2.GenerateResponse(
                    request_id=req.request_id,
                    token_ids=out.token_ids,
                    text=text,
                    finish_reason=finish_to_pb(reason),
                    logprobs=logprobs_list_to_pb(out.logprobs),
                    prompt_logprobs=logprobs_list_to_pb(out.prompt_logprobs),
                    tool_calls=[gateway_pb2.ToolCall(**c) for c in calls],
                    index=out.index,
                )
                ended += reason is not None
                if reason is not None and ended == req.params.n:  # every choice's, summed
                    reply.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=len(req.prompt_ids), completion_tokens=completion
                        )
                    )
                yield reply

    def _chat(self, chat: gateway_pb2.Chat) -> ChatCall:
        """The request's conversation checked and rendered, as the HTTP API's."""
        values = _chat_values(chat)
        check_unicode(values)  # JSON text may escape a lone surrogate, as an HTTP body may
        return chat_call(values, self.chat_template.render, self.tool_parser)


def _answer(tools: WholeCallStream | None, text: str, done: bool) -> tuple[str, list[dict]]:
    """(text, whole calls) of a response: the text itself when no parser reads the answer."""
    if tools is None:
        return text, []
    if done:
        return tools.finish(text)[:2]
    return tools.feed(text)


def _chat_values(chat: gateway_pb2.Chat) -> dict:
    """A `Chat` as the HTTP API's chat body names its fields (chat_request reads both); the
    checks that only the protobuf shape needs name its fields (`chat.tools[0].parameters`)."""
    values: dict = {"messages": [_message(m) for m in chat.messages]}
    if chat.tools:
        values["tools"] = [_tool(i, t) for i, t in enumerate(chat.tools)]
    which = chat.WhichOneof("tool_choice")
    if which == "tool_choice_mode":
        if chat.tool_choice_mode not in TOOL_CHOICE_MODES:
            raise InvalidRequest(
                f"chat.tool_choice_mode must be one of {', '.join(TOOL_CHOICE_MODES)}, got "
                f"{chat.tool_choice_mode!r}; to force one function, name it in "
                "chat.tool_choice_function",
                param="tool_choice",
            )
        values["tool_choice"] = chat.tool_choice_mode
    elif which == "tool_choice_function":
        name = chat.tool_choice_function
        values["tool_choice"] = {"type": "function", "function": {"name": name}}
    if chat.HasField("parallel_tool_calls"):
        values["parallel_tool_calls"] = chat.parallel_tool_calls
    if chat.chat_template_kwargs:
        values["chat_template_kwargs"] = _json_object(
            chat.chat_template_kwargs, "chat.chat_template_kwargs", "chat_template_kwargs"
        )
    if chat.HasField("add_generation_prompt"):
        values["add_generation_prompt"] = chat.add_generation_prompt
    if chat.continue_final_message:
        values["continue_final_message"] = True
    return values


def _message(m: gateway_pb2.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {
                **({"id": c.id} if c.id else {}),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _tool(i: int, tool: gateway_pb2.Tool) -> dict:
    if not tool.name:
        raise InvalidRequest(f"chat.tools[{i}].name is empty: name the function", "tools")
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        where = f"chat.tools[{i}].parameters"
        function["parameters"] = _json_object(tool.parameters, where, "tools")
    return {"type": "function", "function": function}


def _json_object(text: str, where: str, param: str) -> dict:
    """The JSON object `text` holds; InvalidRequest naming `where` if it holds none."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"{where} is not valid JSON: {e}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object, got {text[:40]!r}", param=param)
    return value


class RegistryServicer(gateway_pb2_grpc.WorkerRegistryServicer):
    """What this gateway routes to (workers join in the discovery service, not here)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def ListWorkers(self, request, context):
        now, wall = clock.monotonic(), clock.time_s()
        return gateway_pb2.ListWorkersResponse(
            workers=[
                gateway_pb2.WorkerInfo(
                    worker_id=w.worker_id,
                    role=ROLE_VALUES[w.role],
                    address=w.address,
                    load=common_pb2.WorkerLoad(**vars(w.load)),
                    last_report_unix_ms=int((wall - (now - w.last_seen)) * 1000),
                )
                for w in self.registry.live()
            ]
        )
