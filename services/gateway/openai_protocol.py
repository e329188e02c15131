"""The OpenAI-compatible protocol: JSON bodies in, domain objects out, and the JSON replies.

Pure functions, no web framework here. Which fields exist, and which are honoured or refused, is
openai_fields.FIELDS (checked there); this module turns the honoured ones into a call: the
sampling parameters (ranges are SamplingParams' and build_request's checks, shared with the gRPC
API), the rendered chat prompt, and what the reply carries.

Why one file (~500 lines): a request's fields and the reply they shape are one contract (echo,
return_token_ids, logprobs and stream_options are read on both sides); split, they would drift.
The logprobs objects' own shapes are openai_logprobs.py's; the messages' checks and rendering
are chat_request.py's (shared with the gRPC API), the tools' request checks openai_tools.py's,
their parsers tool_parsers.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import DistServeError, InvalidRequest
from services.common.generation_defaults import GenerationDefaults
from services.common.logprobs import MAX_LOGPROBS, TokenLogprobs
from services.common.sampling import FinishReason, SamplingParams
from services.gateway.chat_request import RenderChat, chat_call, chat_messages, render
from services.gateway.openai_fields import CHAT as CHAT
from services.gateway.openai_fields import COMPLETIONS as COMPLETIONS
from services.gateway.openai_fields import TOKENIZE, TOKENIZE_CHAT, checked, show
from services.gateway.openai_logprobs import LogprobsWriter, TokenTexts, prompt_logprobs
from services.gateway.openai_structured import structured_output
from services.gateway.tool_parsers import ToolParser, tool_calls

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
NO_DEFAULTS = GenerationDefaults()  # a model without generation_config.json sampling defaults


@dataclass(frozen=True)
class CompletionCall:
    """A parsed /v1/completions or /v1/chat/completions request."""

    endpoint: str  # COMPLETIONS or CHAT
    model: str | None
    prompt: str | list[int]
    params: SamplingParams
    fill_context: bool  # max_tokens not given: generate up to the context
    add_special_tokens: bool  # default False for chat (the template writes them)
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage on every streamed chunk
    user: str | None  # end-user ids, for the gateway's log
    safety_identifier: str | None
    echo: bool  # prepend the prompt (completions) or `continued` (chat) to the answer
    continued: str  # chat: the content of the assistant's last message, echoed
    return_token_ids: bool
    request_id: str | None  # the body's request_id; None: the header's, or a new one
    truncate_prompt_tokens: int | None  # keep the prompt's last k tokens (-1: as fit)
    # Alternatives per token in the reply's logprobs (completions' logprobs, chat's
    # top_logprobs); None: no logprobs. Tokens written as `token_id:<id>`.
    logprobs: int | None = None
    tokens_as_ids: bool = False
    prompt_logprobs: bool = False  # the reply carries `prompt_logprobs` (vLLM's)
    # tool_choice "auto" with tools: the answer is read by this parser into tool_calls
    tool_parser: ToolParser | None = None


@dataclass(frozen=True)
class TokenizeCall:
    """A parsed /tokenize request: a prompt, or messages rendered to one."""

    model: str | None
    prompt: str
    add_special_tokens: bool
    return_token_strs: bool


def check_unicode(body: object) -> None:
    """Refuse a body holding a lone surrogate: `"\\ud800"` is valid JSON, but no Unicode text,
    so it could be neither tokenized nor echoed back. Names the field (iteratively: a body may
    nest as deep as the JSON parser allows)."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in value.items())
            stack.extend((path or "body", k) for k in value)  # keys are text too
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as e:
                bad = value[e.start]
                raise InvalidRequest(
                    f"'{path}' holds a lone surrogate (\\u{ord(bad):04x}), which is no valid "
                    "Unicode text; send whole characters (a surrogate pair, or UTF-8)",
                    param=None if path == "body" else path.split(".")[0].split("[")[0],
                ) from None


def parse(
    endpoint: str,
    body: object,
    render_chat: RenderChat | None = None,
    defaults: GenerationDefaults = NO_DEFAULTS,
    tool_parser: ToolParser | None = None,
) -> CompletionCall:
    """Check a request body against openai_fields.FIELDS and build the call. `render_chat`
    renders chat messages (CHAT only). `defaults` (the model's generation_config.json) stand in
    for sampling fields the body leaves out; its max_tokens caps a request that names none.
    `tool_parser` (the gateway's --tool-call-parser) reads the answers of tool_choice "auto".
    Raises InvalidRequest, naming the field, for anything that is off."""
    values = checked(endpoint, body)
    stream = values.get("stream", False)
    include_usage, continuous_usage = _stream_options(values.get("stream_options"), stream)
    stop = values.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    stop_token_ids = tuple(values.get("stop_token_ids", ()))
    echo = values.get("echo", False)
    continued = ""
    chat = None
    if endpoint == CHAT:
        chat = chat_call(values, render_chat, tool_parser)
        messages = chat.messages
        prompt: str | list[int] = chat.prompt.text
        if echo:
            if messages[-1]["role"] != "assistant":
                raise InvalidRequest(
                    "'echo' prepends the assistant's last message to the answer, and the last "
                    "message is not the assistant's; drop echo or end with the reply to continue",
                    param="echo",
                )
            continued = messages[-1]["content"]
    else:
        prompt = _prompt(values["prompt"])
    max_tokens = values.get("max_completion_tokens", values.get("max_tokens"))
    fill_context = max_tokens is None and (endpoint == CHAT or defaults.max_tokens is not None)
    top_k = values.get("top_k", _default(defaults.top_k, 0))
    min_tokens = values.get("min_tokens", 0)
    if max_tokens is None:  # OpenAI's default; with fill_context build_request sets it
        max_tokens = max(DEFAULT_COMPLETION_MAX_TOKENS, min_tokens if fill_context else 0)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=values.get("temperature", _default(defaults.temperature, 1.0)),
        top_p=values.get("top_p", _default(defaults.top_p, 1.0)),
        top_k=0 if top_k == -1 else top_k,
        seed=values.get("seed"),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=values.get("ignore_eos", False),
        include_stop_str_in_output=values.get("include_stop_str_in_output", False),
        skip_special_tokens=values.get("skip_special_tokens", True),
        presence_penalty=values.get("presence_penalty", 0.0),
        frequency_penalty=values.get("frequency_penalty", 0.0),
        repetition_penalty=values.get(
            "repetition_penalty", _default(defaults.repetition_penalty, 1.0)
        ),
        min_p=values.get("min_p", _default(defaults.min_p, 0.0)),
        min_tokens=min_tokens,
        logit_bias=_logit_bias(values.get("logit_bias", {})),
        structured_output=structured_output(values),
    )
    if chat is not None:  # the template's stops, a forced call's constraint
        params = chat.applied(params)
    logprobs = _logprobs(endpoint, values)
    prompt_k = values.get("prompt_logprobs")
    if echo and endpoint == COMPLETIONS and logprobs is not None:  # the prompt's, echoed
        prompt_k = max(prompt_k or 0, logprobs)
    best_of = values.get("best_of")
    if stream and best_of is not None and best_of > 1:
        raise InvalidRequest(
            "'best_of' returns the best choices once every one is done, so it cannot stream: "
            "drop stream, or ask for n choices without best_of",
            param="best_of",
        )
    params = dataclasses.replace(
        params,
        logprobs=logprobs,
        prompt_logprobs=prompt_k,
        n=values.get("n", 1),
        best_of=best_of,
    )
    truncate = values.get("truncate_prompt_tokens")
    if truncate is not None and truncate != -1 and truncate < 1:
        raise InvalidRequest(
            f"'truncate_prompt_tokens' must be -1 (as many as fit) or >= 1, got {truncate}",
            param="truncate_prompt_tokens",
        )
    return CompletionCall(
        endpoint=endpoint,
        model=values.get("model"),
        prompt=prompt,
        params=params,
        fill_context=fill_context,
        add_special_tokens=values.get("add_special_tokens", endpoint != CHAT),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=values.get("user"),
        safety_identifier=values.get("safety_identifier"),
        echo=echo,
        continued=continued,
        return_token_ids=values.get("return_token_ids", False),
        request_id=values.get("request_id"),
        truncate_prompt_tokens=truncate,
        logprobs=logprobs,
        tokens_as_ids=values.get("return_tokens_as_token_ids", False),
        prompt_logprobs=prompt_k is not None,
        tool_parser=chat and chat.tool_parser,
    )


def _logprobs(endpoint: str, values: dict) -> int | None:
    """The k of the reply's logprobs: completions' `logprobs` (false: none), chat's
    `top_logprobs` when `logprobs` is true (else top_logprobs must not ask for any)."""
    if endpoint == COMPLETIONS:
        k = values.get("logprobs")
        return None if k is False else k
    k = values.get("top_logprobs")
    if not values.get("logprobs"):
        if k:
            raise InvalidRequest(
                "'top_logprobs' needs 'logprobs': true (it says how many alternatives to "
                "return beside each token's log-probability)",
                param="top_logprobs",
            )
        return None
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequest(
            f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {k}",
            param="top_logprobs",
        )
    return k or 0


def _logit_bias(value: dict) -> dict[int, object]:
    """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), with integer ids."""
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 20):
            raise InvalidRequest(
                f'logit_bias keys must be token ids ("123"), got {show(key)}', param="logit_bias"
            )
        out[int(key)] = bias
    return out


def _default(value: float | None, fallback: float) -> float:
    return fallback if value is None else value


def parse_tokenize(body: object, render_chat: RenderChat) -> TokenizeCall:
    """A /tokenize body: `prompt` (as /v1/completions tokenizes it) or `messages` (rendered
    as /v1/chat/completions renders them)."""
    chat = isinstance(body, dict) and body.get("messages") is not None
    values = checked(TOKENIZE_CHAT if chat else TOKENIZE, body)
    if chat:
        prompt = render(values, chat_messages(values["messages"]), render_chat).text
    else:
        prompt = values["prompt"]
    return TokenizeCall(
        model=values.get("model"),
        prompt=prompt,
        add_special_tokens=values.get("add_special_tokens", not chat),
        return_token_strs=values.get("return_token_strs", False),
    )


def _stream_options(options: dict | None, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of stream_options, every key checked."""
    if options is None:
        return False, False
    if not stream:
        raise InvalidRequest(
            "'stream_options' applies to streamed replies only: set stream to true, or drop "
            "it (a whole reply always carries its usage)",
            param="stream_options",
        )
    flags = {"include_usage": False, "continuous_usage_stats": False}
    for key, value in options.items():
        if key in flags and (value is None or isinstance(value, bool)):
            flags[key] = bool(value)
        elif key in flags:
            raise InvalidRequest(
                f"'stream_options.{key}' must be true or false, got {show(value)}",
                param="stream_options",
            )
        elif key == "include_obfuscation" and (value is None or value is False):
            continue
        elif key == "include_obfuscation":
            raise InvalidRequest(
                "'stream_options.include_obfuscation' is not supported: this server pads no "
                "stream events; leave it unset or send false",
                param="stream_options",
            )
        else:
            raise InvalidRequest(
                f"'stream_options.{key}' is not an option: include_usage and "
                "continuous_usage_stats are",
                param="stream_options",
            )
    if flags["continuous_usage_stats"] and not flags["include_usage"]:
        raise InvalidRequest(
            "'stream_options.continuous_usage_stats' needs include_usage: true",
            param="stream_options",
        )
    return flags["include_usage"], flags["continuous_usage_stats"]


def _prompt(value: str | list) -> str | list[int]:
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) != 1:
            raise InvalidRequest(
                f"'prompt' holds {len(value)} prompts; this server takes one prompt per "
                "request: send one request each",
                param="prompt",
            )
        return value[0]
    return value


# Replies ------------------------------------------------------------------------------------


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Answer:
    """One choice of a whole (non-streamed) reply: its text, why it ended, its token ids and
    their logprobs (when asked)."""

    index: int
    text: str
    reason: FinishReason | None
    token_ids: list[int]
    logprobs: Sequence[TokenLogprobs] = ()


@dataclass(frozen=True)
class Reply:
    """Writes the JSON replies of one call: its id, creation time and model are fixed. Token
    ids are added only when the call asked for them (return_token_ids), logprobs likewise
    (their text from `token_texts`; openai_logprobs.py has their shapes)."""

    call: CompletionCall
    id: str
    created: int
    model: str
    prompt_ids: list[int]
    token_texts: TokenTexts | None = None
    writer: LogprobsWriter | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.call.logprobs is not None and self.token_texts is not None:
            writer = LogprobsWriter(self.call.logprobs, self.token_texts, self.call.tokens_as_ids)
            object.__setattr__(self, "writer", writer)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: Sequence[TokenLogprobs],
        prompt: Sequence[TokenLogprobs] | None,
        first: bool,
    ) -> dict | None:
        """A choice's `logprobs`: its tokens' (after the echoed prompt's, on completions'
        first), or None when not asked."""
        if self.writer is None:
            return None
        if self.call.endpoint == CHAT:
            return self.writer.chat(logprobs)
        positions = list(zip(token_ids, logprobs, strict=True))
        if first and self.call.echo:
            if prompt is None or len(prompt) != len(self.prompt_ids) - 1:
                raise DistServeError(f"request {self.id}: its prompt's logprobs did not come")
            positions = [*zip(self.prompt_ids, [None, *prompt], strict=True), *positions]
        return self.writer.completion(positions)

    def _prompt_logprobs(self, prompt: Sequence[TokenLogprobs] | None) -> dict:
        """{"prompt_logprobs": ...} when the call asked for them, else nothing."""
        if not self.call.prompt_logprobs or self.token_texts is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(prompt or (), self.token_texts)}

    def whole(
        self,
        answers: Sequence[Answer],
        used: dict,
        prompt: Sequence[TokenLogprobs] | None = None,
    ) -> dict:
        """The non-streaming reply: a choice per answer (n of them), `prompt` the prompt's
        logprobs (positions 1..) when asked; `used` the usage of all choices."""
        choices = [self._choice(a, prompt) for a in answers]
        if self.call.endpoint == CHAT:
            out = {**self._head("chat.completion"), "choices": choices, "usage": used}
            out.update(self._prompt_logprobs(prompt))
            if self.call.return_token_ids:
                out["prompt_token_ids"] = self.prompt_ids
            return out
        return {**self._head("text_completion"), "choices": choices, "usage": used}

    def _choice(self, answer: Answer, prompt: Sequence[TokenLogprobs] | None) -> dict:
        """One choice of the non-streaming reply."""
        text, reason, token_ids = answer.text, answer.reason, answer.token_ids
        ids = self.call.return_token_ids
        lps = self._logprobs(token_ids, answer.logprobs, prompt, first=True)
        if self.call.endpoint == CHAT:
            message: dict = {"role": "assistant", "content": text}
            reason_text = finish_reason(reason)
            parsed = self.call.tool_parser and self.call.tool_parser.parse(text)
            if parsed and parsed.calls:  # unreadable calls stay content (as vLLM)
                message = {**message, "content": parsed.content or None}
                message["tool_calls"] = tool_calls(parsed)
                reason_text = "tool_calls"
            return {
                "index": answer.index,
                "message": message,
                "logprobs": lps,
                "finish_reason": reason_text,
                **({"token_ids": token_ids} if ids else {}),
            }
        choice = {"index": answer.index, "text": text, "logprobs": lps}
        choice["finish_reason"] = finish_reason(reason)
        if ids:
            choice.update(token_ids=token_ids, prompt_token_ids=self.prompt_ids)
        choice.update(self._prompt_logprobs(prompt))
        return choice

    def chunk(
        self,
        text: str,
        reason: FinishReason | None,
        token_ids: list[int],
        used: dict,
        *,
        first: bool = False,
        logprobs: Sequence[TokenLogprobs] = (),
        prompt: Sequence[TokenLogprobs] | None = None,
        tool_deltas: Sequence[dict] = (),
        called: bool = False,
        index: int = 0,
    ) -> dict:
        """One streamed chunk of choice `index`; `first` (its choice's first) adds the
        assistant role (chat), the prompt's ids (return_token_ids) and, given `prompt`, its
        logprobs (prompt_logprobs, and completions' echo);
        `used` is the usage so far (sent with continuous_usage_stats). `tool_deltas` are
        `delta.tool_calls` (tool_parsers.ToolCallStream); `called`: the answer called tools,
        so the last chunk's finish_reason is `tool_calls`."""
        ids = self.call.return_token_ids
        lps = self._logprobs(token_ids, logprobs, prompt, first)
        extra = self._prompt_logprobs(prompt) if first else {}
        if self.call.endpoint == CHAT:
            delta: dict = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            if tool_deltas:
                delta["tool_calls"] = list(tool_deltas)
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": lps,
                "finish_reason": "tool_calls" if called and reason else finish_reason(reason),
                **({"token_ids": token_ids} if ids else {}),
            }
            out = {**self._head("chat.completion.chunk"), "choices": [choice], **extra}
            if ids and first:
                out["prompt_token_ids"] = self.prompt_ids
        else:
            choice = {"index": index, "text": text, "logprobs": lps}
            choice["finish_reason"] = finish_reason(reason)
            if ids:
                choice["token_ids"] = token_ids
                if first:
                    choice["prompt_token_ids"] = self.prompt_ids
            choice.update(extra)
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.call.include_usage:
            out["usage"] = used if self.call.continuous_usage else None
        return out

    def usage_chunk(self, used: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        obj = "chat.completion.chunk" if self.call.endpoint == CHAT else "text_completion"
        return {**self._head(obj), "choices": [], "usage": used}
