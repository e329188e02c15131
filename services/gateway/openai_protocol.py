"""The OpenAI-compatible protocol: JSON bodies in, domain objects out, and the JSON replies.

Pure functions, no web framework here. PARAMETERS is the one table of accepted request fields:
the parser checks types with it and the OpenAPI document (openapi.py) is written from it, so
the two cannot drift. Value ranges are SamplingParams' and build_request's checks, shared with
the gRPC API. Fields not in the table are ignored, as OpenAI servers do; fields of OpenAI's API
that this server cannot honour are refused with a 400 when set to anything but their default
(UNSUPPORTED), rather than silently ignored.

Why one file (~470 lines): the parameter table, its validation and the response shapes are
one contract; split, the table and the code reading it would drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.sampling import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    FinishReason,
    SamplingParams,
)
from services.gateway.chat_template import ROLES

COMPLETIONS, CHAT = "completions", "chat"
BOTH = (COMPLETIONS, CHAT)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Kind:
    """A JSON type a field may have: its check and its JSON schema (for OpenAPI)."""

    check: Callable[[object], bool]
    schema: dict
    words: str  # for error messages: "must be {words}"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list) and all(_is_int(t) for t in x)


def _is_prompt(x: object) -> bool:
    return (
        isinstance(x, str)
        or _is_token_ids(x)
        or (isinstance(x, list) and all(isinstance(p, str) or _is_token_ids(p) for p in x))
    )


INT = Kind(_is_int, {"type": "integer"}, "an integer")
NUMBER = Kind(_is_number, {"type": "number"}, "a number")
BOOL = Kind(lambda x: isinstance(x, bool), {"type": "boolean"}, "true or false")
STRING = Kind(lambda x: isinstance(x, str), {"type": "string"}, "a string")
OBJECT = Kind(lambda x: isinstance(x, dict), {"type": "object"}, "an object")
STOP = Kind(
    lambda x: isinstance(x, str) or (isinstance(x, list) and all(isinstance(s, str) for s in x)),
    {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "a string or an array of strings",
)
TOKEN_IDS = Kind(
    _is_token_ids, {"type": "array", "items": {"type": "integer"}}, "an array of integers"
)
PROMPT = Kind(
    _is_prompt,
    {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "integer"}},
            {"type": "array", "items": {"type": "string"}, "maxItems": 1},
            {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}},
                "maxItems": 1,
            },
        ]
    },
    "a string, an array of token ids, or an array holding one of those",
)
MESSAGES = Kind(
    lambda x: isinstance(x, list),
    {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"type": "string", "enum": list(ROLES)},
                "content": {
                    "oneOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {
                                    "type": {"const": "text"},
                                    "text": {"type": "string"},
                                },
                            },
                        },
                        {"type": "null"},
                    ]
                },
                "name": {"type": ["string", "null"]},
            },
        },
    },
    "an array of message objects",
)


@dataclass(frozen=True)
class Param:
    name: str
    kind: Kind
    description: str
    endpoints: tuple[str, ...] = BOTH
    required: bool = False
    extra: dict | None = None  # more JSON schema (ranges, defaults) for the document


PARAMETERS: tuple[Param, ...] = (
    Param("model", STRING, "A model from GET /v1/models; omitted: the served model."),
    Param(
        "prompt",
        PROMPT,
        "The prompt: text, or token ids. One prompt per request.",
        (COMPLETIONS,),
        required=True,
    ),
    Param(
        "messages",
        MESSAGES,
        "The conversation, rendered with the model's chat template (text content only).",
        (CHAT,),
        required=True,
    ),
    Param(
        "max_tokens",
        INT,
        "Most tokens to generate. Default: 16 for completions; for chat, the rest of the context.",
        extra={"minimum": 1},
    ),
    Param(
        "max_completion_tokens",
        INT,
        "The same as max_tokens (OpenAI's newer name); wins when both are set.",
        extra={"minimum": 1},
    ),
    Param(
        "temperature",
        NUMBER,
        "0 is greedy; higher samples more freely.",
        extra={"minimum": 0, "default": 1},
    ),
    Param(
        "top_p",
        NUMBER,
        "Nucleus sampling: keep the most likely tokens up to this probability mass.",
        extra={"exclusiveMinimum": 0, "maximum": 1, "default": 1},
    ),
    Param(
        "top_k",
        INT,
        "Extension: keep only the k most likely tokens; 0 or -1 is off.",
        extra={"minimum": -1, "maximum": MAX_TOP_K, "default": 0},
    ),
    Param(
        "seed",
        INT,
        "Reproducible sampling: same prompt, parameters and seed give the same tokens.",
        extra={"minimum": 0, "maximum": 2**63 - 1},
    ),
    Param(
        "stop",
        STOP,
        "Up to 16 strings (each up to 256 characters) that end generation; "
        "the returned text stops before the first one.",
    ),
    Param("n", INT, "Choices per request: only 1 is supported.", extra={"enum": [1]}),
    Param("stream", BOOL, "Stream server-sent events, ending with `data: [DONE]`."),
    Param(
        "stream_options",
        OBJECT,
        '`{"include_usage": true}` adds a last chunk with `usage` (and `usage: null` on '
        "the others).",
    ),
    Param("user", STRING, "An end-user id, written to the gateway's log."),
    Param("ignore_eos", BOOL, "Extension: keep generating past the end-of-sequence token."),
    Param(
        "stop_token_ids",
        TOKEN_IDS,
        "Extension: token ids that end generation (up to 64).",
    ),
    Param(
        "presence_penalty",
        NUMBER,
        "Subtracted once from the logit of each token the output already holds.",
        extra={"minimum": -2, "maximum": 2, "default": 0},
    ),
    Param(
        "frequency_penalty",
        NUMBER,
        "Subtracted from a token's logit once per time the output already holds it.",
        extra={"minimum": -2, "maximum": 2, "default": 0},
    ),
    Param(
        "logit_bias",
        OBJECT,
        "Token id (a string key) -> bias in [-100, 100] added to its logit (up to 1024).",
        extra={
            "propertyNames": {"pattern": "^[0-9]{1,20}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
        },
    ),
    Param(
        "repetition_penalty",
        NUMBER,
        "Extension: a seen token's (prompt or output) logit is divided by it when positive, "
        "multiplied when negative; > 1 discourages repeats.",
        extra={"minimum": MIN_REPETITION_PENALTY, "maximum": MAX_REPETITION_PENALTY, "default": 1},
    ),
    Param(
        "min_p",
        NUMBER,
        "Extension: sample only tokens at least min_p times as likely as the most likely one.",
        extra={"minimum": 0, "maximum": 1, "default": 0},
    ),
    Param(
        "min_tokens",
        INT,
        "Extension: EOS, stop_token_ids and stop strings do not end generation before this "
        "many tokens (at most max_tokens).",
        extra={"minimum": 0, "default": 0},
    ),
)
PARAMETERS_BY_NAME = {p.name: p for p in PARAMETERS}


@dataclass(frozen=True)
class Unsupported:
    name: str
    is_default: Callable[[object], bool]
    endpoints: tuple[str, ...] = BOTH


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("logprobs", lambda v: v in (None, False, 0)),
    Unsupported("top_logprobs", lambda v: v in (None, 0), (CHAT,)),
    Unsupported("echo", lambda v: v in (None, False), (COMPLETIONS,)),
    Unsupported("suffix", lambda v: v in (None, ""), (COMPLETIONS,)),
    Unsupported("best_of", lambda v: v in (None, 1), (COMPLETIONS,)),
    Unsupported(
        "response_format",
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        (CHAT,),
    ),
    Unsupported("tool_choice", lambda v: v in (None, "none", "auto"), (CHAT,)),
)


@dataclass(frozen=True)
class CompletionCall:
    """A parsed /v1/completions or /v1/chat/completions request."""

    endpoint: str  # COMPLETIONS or CHAT
    model: str | None
    prompt: str | list[int]
    params: SamplingParams
    fill_context: bool  # max_tokens not given: generate up to the context
    add_special_tokens: bool  # False for chat (the template writes them)
    stream: bool
    include_usage: bool
    user: str | None


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


def parse(endpoint: str, body: object, render_chat: Callable | None = None) -> CompletionCall:
    """Check a request body against PARAMETERS and UNSUPPORTED and build the call.

    `render_chat(messages) -> ChatPrompt` renders chat messages (CHAT only). Raises
    InvalidRequest, naming the parameter, for anything that is off.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    values = {}
    for p in PARAMETERS:
        if endpoint not in p.endpoints:
            continue
        value = body.get(p.name)
        if value is None:
            if p.required:
                raise InvalidRequest(f"'{p.name}' is required", param=p.name)
            continue
        if not p.kind.check(value):
            raise InvalidRequest(
                f"'{p.name}' must be {p.kind.words}, got {_show(value)}", param=p.name
            )
        values[p.name] = value
    for u in UNSUPPORTED:
        if endpoint in u.endpoints and not u.is_default(body.get(u.name)):
            raise InvalidRequest(
                f"'{u.name}' is not supported by this server; leave it unset", param=u.name
            )
    if values.get("n", 1) != 1:
        raise InvalidRequest(
            f"'n' must be 1: this server returns one choice per request, got {values['n']}; "
            "send several requests instead",
            param="n",
        )
    stream_options = values.get("stream_options") or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest(
            "'stream_options.include_usage' must be true or false", param="stream_options"
        )

    stop = values.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    stop_token_ids = tuple(values.get("stop_token_ids", ()))
    if endpoint == CHAT:
        chat = render_chat(_messages(values["messages"]))
        prompt: str | list[int] = chat.text
        stop += chat.stop
        stop_token_ids += chat.stop_token_ids
    else:
        prompt = _prompt(values["prompt"])
    max_tokens = values.get("max_completion_tokens", values.get("max_tokens"))
    fill_context = max_tokens is None and endpoint == CHAT
    top_k = values.get("top_k", 0)
    min_tokens = values.get("min_tokens", 0)
    if max_tokens is None:  # OpenAI's default; for chat (fill_context) build_request sets it
        max_tokens = max(DEFAULT_COMPLETION_MAX_TOKENS, min_tokens if fill_context else 0)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=values.get("temperature", 1.0),
        top_p=values.get("top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,
        seed=values.get("seed"),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=values.get("ignore_eos", False),
        presence_penalty=values.get("presence_penalty", 0.0),
        frequency_penalty=values.get("frequency_penalty", 0.0),
        repetition_penalty=values.get("repetition_penalty", 1.0),
        min_p=values.get("min_p", 0.0),
        min_tokens=min_tokens,
        logit_bias=_logit_bias(values.get("logit_bias", {})),
    )
    return CompletionCall(
        endpoint=endpoint,
        model=values.get("model"),
        prompt=prompt,
        params=params,
        fill_context=fill_context,
        add_special_tokens=endpoint != CHAT,
        stream=values.get("stream", False),
        include_usage=include_usage,
        user=values.get("user"),
    )


def _logit_bias(value: dict) -> dict[int, object]:
    """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), with integer ids."""
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 20):
            raise InvalidRequest(
                f'logit_bias keys must be token ids ("123"), got {_show(key)}',
                param="logit_bias",
            )
        out[int(key)] = bias
    return out


def _prompt(value: str | list) -> str | list[int]:
    if isinstance(value, list) and value and not _is_int(value[0]):
        if len(value) != 1:
            raise InvalidRequest(
                f"'prompt' holds {len(value)} prompts; this server takes one prompt per "
                "request: send one request each",
                param="prompt",
            )
        return value[0]
    return value


def _messages(messages: list) -> list[dict]:
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
        content = m.get("content")
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
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or an array of text parts",
                param="messages",
            )
        message = {"role": m["role"], "content": content}
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(
                f"messages[{i}].name must be a string, got {_show(name)}", param="messages"
            )
        if name is not None:
            message["name"] = name
        out.append(message)
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
class Reply:
    """Writes the JSON replies of one call: its id, creation time and model are fixed."""

    call: CompletionCall
    id: str
    created: int
    model: str

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: FinishReason | None, used: dict) -> dict:
        """The non-streaming reply."""
        if self.call.endpoint == CHAT:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason(reason),
            }
            return {**self._head("chat.completion"), "choices": [choice], "usage": used}
        choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason(reason)
        return {**self._head("text_completion"), "choices": [choice], "usage": used}

    def chunk(self, text: str, reason: FinishReason | None, *, first: bool = False) -> dict:
        """One streamed chunk; `first` adds the assistant role (chat)."""
        if self.call.endpoint == CHAT:
            delta: dict = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason(reason),
            }
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            choice["finish_reason"] = finish_reason(reason)
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.call.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, used: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        obj = "chat.completion.chunk" if self.call.endpoint == CHAT else "text_completion"
        return {**self._head(obj), "choices": [], "usage": used}
