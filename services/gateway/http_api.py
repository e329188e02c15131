"""The OpenAI-compatible HTTP API of the gateway (aiohttp, on the gateway's event loop).

Handlers are thin: parse the body (openai_protocol), build the Request through the same
validation as gRPC (request.build_request), stream Router.generate's events back as JSON or
server-sent events. Exceptions become HTTP statuses and OpenAI-shaped error bodies in one
place (http_errors.py). Errors before the first token get their status; an error after the
stream has started is sent as a last `data: {"error": ...}` event (the status line is gone).

A client that disconnects cancels its handler (handler_cancellation), which closes the
router's stream and cancels the request everywhere downstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common import clock, telemetry
from services.common.errors import DistServeError, InvalidRequest, NotFound
from services.common.generation_defaults import GenerationDefaults
from services.common.sampling import FinishReason
from services.common.tokenizer import Tokenizer
from services.gateway import openai_fields as fields
from services.gateway import openai_protocol as oai
from services.gateway.chat_template import ChatTemplate
from services.gateway.events import Done, Output
from services.gateway.http_errors import (
    MAX_BODY_BYTES,
    error_body,
    errors_middleware,
    json_response,
    plain_error,
)
from services.gateway.openapi import openapi_document
from services.gateway.request import (
    MAX_PROMPT_CHARS,
    THREAD_TOKENIZE_CHARS,
    Limits,
    Request,
    build_request,
)
from services.gateway.router import Router
from services.gateway.routing import Routing
from services.gateway.tool_parsers import ToolCallStream, tool_parser

log = logging.getLogger("distserve.gateway.http")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# OpenAI's paths this server does not serve, each with a 404 that says so (not "no such path").
NOT_SERVED = {
    "/v1/embeddings": "embeddings",
    "/v1/audio/{rest:.*}": "audio (speech, transcriptions, translations)",
    "/v1/images/{rest:.*}": "images",
    "/v1/responses": "OpenAI's Responses API",
}


@dataclass(frozen=True)
class HttpApiConfig:
    model_names: tuple[str, ...]  # names a request's `model` may use; the first is listed first
    max_body_bytes: int = 8 * 2**20
    engine: str = "torch"  # "emulated": the workers model their steps (said in /v1/models)
    # Sampling defaults of a request that sets none (generation_config.json, --generation-config)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    serve_metrics: bool = True  # GET /metrics: the gateway's Prometheus metrics
    tool_call_parser: str | None = None  # --tool-call-parser: reads tool_choice "auto" answers


class HttpApi:
    """Routes of the OpenAI-compatible API over one Router."""

    def __init__(
        self,
        config: HttpApiConfig,
        router: Router,
        routing: Routing,
        tokenizer: Tokenizer,
        limits: Limits,
        chat_template: ChatTemplate,
    ) -> None:
        self.config = config
        self.router = router
        self.routing = routing
        self.tokenizer = tokenizer
        self.limits = limits
        self.chat_template = chat_template
        self.created = int(time.time())
        parser = config.tool_call_parser
        self.tool_parser = None if parser is None else tool_parser(parser)
        self._openapi = json.dumps(openapi_document(config.model_names[0]), indent=1)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[errors_middleware]
        )
        app[MAX_BODY_BYTES] = self.config.max_body_bytes
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # names may hold slashes
        app.router.add_get("/health", self.health)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        if self.config.serve_metrics:
            app.router.add_get("/metrics", self.metrics)
        for path, what in NOT_SERVED.items():
            app.router.add_route("*", path, _not_served(what))
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, oai.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, oai.CHAT)

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model(n) for n in self.config.model_names]})

    async def model(self, request: web.Request) -> web.Response:
        return _json(self._model(self._served(request.match_info["model"])))

    async def health(self, request: web.Request) -> web.Response:
        """200 when a request can be served now (a complete path of workers), else 503."""
        mode = self.routing.mode()  # Unavailable -> 503 with the reason
        live = self.routing.registry.live
        counts = {r: len(live(r)) for r in ("prefill", "decode", "colocated")}
        return _json({"status": "ok", "mode": mode, "workers": counts})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(text=self._openapi, content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt tokenized as /v1/completions does, or messages rendered
        and tokenized as /v1/chat/completions does; no context limit applies (it counts)."""
        call = oai.parse_tokenize(await _body(request), self.chat_template.render)
        self._served(call.model)
        ids = await self._encode(call.prompt, call.add_special_tokens)
        out = {"count": len(ids), "max_model_len": self.limits.max_context, "tokens": ids}
        if call.return_token_strs:
            out["token_strs"] = [self.tokenizer.token(t) for t in ids]
        return _json(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        values = fields.checked(fields.DETOKENIZE, await _body(request))
        self._served(values.get("model"))
        ids = values["tokens"]
        bad = next((t for t in ids if not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary [0, {self.limits.vocab_size})",
                param="tokens",
            )
        return _json({"prompt": self.tokenizer.decode(ids)})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": importlib.metadata.version("distserve-mesh")})

    async def metrics(self, request: web.Request) -> web.Response:
        """The gateway's Prometheus metrics (the same registry as its --metrics-port), so the
        edge can route /metrics to them."""
        body = generate_latest(self.router.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _model(self, name: str) -> dict:
        engine = self.config.engine
        owner = "distserve" if engine == "torch" else f"distserve ({engine})"
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": owner,
            "distserve_engine": self.config.engine,
            "max_model_len": self.limits.max_context,  # the workers' smallest (request.Limits)
        }

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a text, on a worker thread when it is long."""
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequest(
                f"prompt text is longer than {MAX_PROMPT_CHARS} characters", param="prompt"
            )
        if len(text) > THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def _prompt(self, call: oai.CompletionCall) -> str | list[int]:
        """The prompt build_request gets: with truncate_prompt_tokens, the last k token ids."""
        k, prompt = call.truncate_prompt_tokens, call.prompt
        if k is None or not prompt:
            return prompt
        ids = (
            await self._encode(prompt, call.add_special_tokens)
            if isinstance(prompt, str)
            else prompt
        )
        if k == -1:  # as many as fit the context with max_tokens (or one token, filling it)
            k = max(
                1, self.limits.max_context - (1 if call.fill_context else call.params.max_tokens)
            )
        return ids[-k:]

    def _served(self, name: str | None) -> str:
        if name is None:
            return self.config.model_names[0]
        if name not in self.config.model_names:
            raise NotFound(
                f"the model '{name}' is not served here; GET /v1/models lists what is "
                f"({', '.join(self.config.model_names)})",
                param="model",
            )
        return name

    async def _complete(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        received = clock.monotonic()
        call = oai.parse(
            endpoint,
            await _body(request),
            self.chat_template.render,
            self.config.generation,
            self.tool_parser,
        )
        model = self._served(call.model)
        req = await build_request(
            await self._prompt(call),
            call.params,
            self.tokenizer,
            self.limits,
            request_id=call.request_id or request.headers.get("x-request-id", ""),
            fill_context=call.fill_context,
            add_special_tokens=call.add_special_tokens,
        )
        prefix = "chatcmpl-" if endpoint == oai.CHAT else "cmpl-"
        reply = oai.Reply(
            call,
            prefix + req.request_id,
            int(time.time()),
            model,
            req.prompt_ids,
            self.tokenizer.token_texts,
        )
        echo = self._echo(call, req)
        if call.user:
            log.info("request %s from user %r", req.request_id, call.user)
        if call.safety_identifier:
            log.info("request %s from safety identifier %r", req.request_id, call.safety_identifier)
        events = self.router.generate(
            req,
            telemetry.from_headers(request.headers),
            "chat" if endpoint == oai.CHAT else "text_completion",
            received,
        )
        async with contextlib.aclosing(events):
            # The first event comes before any byte of the reply: errors until then (no worker,
            # a refused request) get their own HTTP status.
            first = await anext(events)
            if call.stream:
                return await self._stream(request, req, reply, echo, first, events)
            # Per choice: its text pieces, token ids, logprobs and last event.
            texts: dict[int, list[str]] = {}
            ids: dict[int, list[int]] = {}
            logprobs: dict[int, list] = {}
            last: dict[int, Output] = {}
            prompt = first.prompt_logprobs
            async for out in _chain(first, events):
                i = out.index
                texts.setdefault(i, [echo]).append(out.text)
                ids.setdefault(i, []).extend(out.token_ids)
                logprobs.setdefault(i, []).extend(out.logprobs)
                last[i] = out
                prompt = prompt or out.prompt_logprobs
            total = oai.usage(len(req.prompt_ids), sum(len(t) for t in ids.values()))
            answers = [
                oai.Answer(i, "".join(texts[i]), _reason(last[i]), ids[i], logprobs[i])
                for i in sorted(texts)
            ]
            return _json(reply.whole(answers, total, prompt), req)

    def _echo(self, call: oai.CompletionCall, req: Request) -> str:
        """What echo puts before the answer: the prompt as sent (its text; token ids or a
        truncated prompt: the text of the ids served), or the continued assistant message."""
        if not call.echo:
            return ""
        if call.endpoint == oai.CHAT:
            return call.continued
        if isinstance(call.prompt, str) and call.truncate_prompt_tokens is None:
            return call.prompt
        return self.tokenizer.decode(req.prompt_ids)

    async def _stream(
        self,
        request: web.Request,
        req: Request,
        reply: oai.Reply,
        echo: str,
        first: Output,
        events: AsyncIterator[Output],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, "x-request-id": req.request_id})
        await response.prepare(request)
        prompt = len(req.prompt_ids)
        prompt_logprobs = first.prompt_logprobs
        used = ended = 0
        parser = reply.call.tool_parser
        # Per choice (n > 1): its tool-call reader; a choice's first chunk opens it.
        tools: dict[int, ToolCallStream | None] = {}
        # Tokens whose text is held back still carry ids or logprobs when those were asked.
        every = reply.call.return_token_ids or reply.call.logprobs is not None
        try:
            async for out in _chain(first, events):
                used += len(out.token_ids)
                done = isinstance(out, Done)
                ended += done
                opens = out.index not in tools
                if opens:
                    tools[out.index] = None if parser is None else ToolCallStream(parser)
                piece = echo + out.text if opens else out.text
                text, deltas, called = _pieces(tools[out.index], piece, done)
                if opens or text or deltas or done or (every and out.token_ids):
                    chunk = reply.chunk(
                        text,
                        _reason(out),
                        out.token_ids,
                        oai.usage(prompt, used),
                        first=opens,
                        logprobs=out.logprobs,
                        prompt=prompt_logprobs if opens else None,
                        tool_deltas=deltas,
                        called=called,
                        index=out.index,
                    )
                    await _event(response, chunk)
        except DistServeError as e:
            # Too late for a status: the error becomes the stream's last event.
            await _event(response, error_body(e)[1])
            log.info("request %s failed mid-stream: %s", req.request_id, e)
        else:
            if ended < req.params.n:
                log.warning("request %s ended without a finish reason", req.request_id)
            if reply.call.include_usage:
                await _event(response, reply.usage_chunk(oai.usage(prompt, used)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _body(request: web.Request) -> object:
    """The request's JSON body, its strings checked to be Unicode text."""
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, huge ints, deep nesting
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from e
    oai.check_unicode(body)
    return body


def _not_served(what: str):
    async def handler(request: web.Request) -> web.Response:
        message = (
            f"this server does not serve {what} ({request.path}): it serves text generation, "
            "POST /v1/completions and /v1/chat/completions"
        )
        return plain_error(404, message, "not_served")

    return handler


def _pieces(tools: ToolCallStream | None, text: str, done: bool) -> tuple[str, list[dict], bool]:
    """(content, delta.tool_calls, whether tools were called) of a streamed piece of text:
    the text itself when no tool parser reads the answer."""
    if tools is None:
        return text, [], False
    if done:
        return tools.finish(text)
    return (*tools.feed(text), False)


async def _chain(first: Output, rest: AsyncIterator[Output]) -> AsyncIterator[Output]:
    """The stream's first event (read before the reply began), then the rest."""
    yield first
    async for out in rest:
        yield out


def _reason(out: Output) -> FinishReason | None:
    return out.reason if isinstance(out, Done) else None


async def _event(response: web.StreamResponse, payload: dict) -> None:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    await response.write(b"data: " + data.encode() + b"\n\n")


def _json(payload: dict, req: Request | None = None, status: int = 200) -> web.Response:
    headers = {"x-request-id": req.request_id} if req is not None else None
    return json_response(payload, status=status, headers=headers)
