"""The OpenAPI 3.1 document of the HTTP API, served at /openapi.json.

Request schemas are written from openai_fields.FIELDS (the table the parser checks), so the
document describes what the server accepts, and what it refuses: a refused field's schema admits
only the values that change nothing, and a field of no schema only as null. Tests check the
routes and the behaviour.
"""

from __future__ import annotations

import json

from services.gateway import openai_fields as fields
from services.gateway import openai_protocol as oai

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}
_MODEL_PATH_PARAM = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", "tool_calls", None]}
# message.tool_calls: the calls the --tool-call-parser read (tool_choice auto).
_TOOL_CALLS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    },
}
# delta.tool_calls: a call's index, id, type and name once, then its arguments in pieces.
_TOOL_CALL_DELTAS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["index"],
        "properties": {
            "index": {"type": "integer"},
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    },
}
_ERRORS = {
    "400": "Invalid JSON, a parameter of the wrong type or out of range, or an unsupported "
    "parameter (the `param` field names it)",
    "401": "A valid API key is required (when the edge has keys): `Authorization: Bearer KEY`",
    "404": "The model is not served here",
    "413": "The request body is larger than the limit",
    "429": "Rate limit reached (the edge's local rate limit)",
    "503": "No complete serving path (no prefill + decode, nor colocated, instance)",
    "504": "The request's deadline passed",
    "500": "A server fault (never bad input); the message says what, where it is safe to",
}


def _request_schema(endpoint: str) -> dict:
    props, required = {}, []
    for f in fields.BY_ENDPOINT[endpoint].values():
        if f.honoured:
            schema = {**f.kind.schema, **(f.extra or {})}
            about = f.about
        else:
            schema = {"enum": list(f.defaults)} if f.defaults else {"type": "null"}
            only = " or ".join(json.dumps(d) for d in f.defaults)
            about = f"Refused ({f.origin}): {f.about}." + (
                f" Accepted only as {only}." * bool(only)
            )
        if f.required:
            required.append(f.name)
        else:  # null is the same as unset, as with OpenAI's API
            schema = {"anyOf": [schema, {"type": "null"}]}
        props[f.name] = {**schema, "description": about}
    return {
        "type": "object",
        "required": required,
        "properties": props,
        "additionalProperties": {"type": "null"},
        "description": "Every field this server knows, honoured or refused. Any other field is "
        "refused with a 400 naming it, unless null.",
    }


# A choice's logprobs (null unless asked): completions' {tokens, token_logprobs, top_logprobs,
# text_offset} or chat's {content: [...]} (services/gateway/openai_logprobs.py).
_LOGPROBS = {"anyOf": [{"type": "object"}, {"type": "null"}]}


def _completion_reply(chat: bool) -> dict:
    if chat:
        choice = {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},
                    "tool_calls": _TOOL_CALLS,
                },
            },
            "finish_reason": _FINISH,
        }
    else:
        choice = {"index": {"type": "integer"}, "text": {"type": "string"}}
        choice["finish_reason"] = _FINISH
    choice["logprobs"] = _LOGPROBS
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if chat else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "properties": choice}},
            "usage": _USAGE,
        },
    }


def _chunk(chat: bool) -> dict:
    """One streamed chunk (the usage chunk has no choices and the usage)."""
    if chat:
        delta = {
            "type": "object",
            "properties": {
                "role": {"const": "assistant"},
                "content": {"type": "string"},
                "tool_calls": _TOOL_CALL_DELTAS,
            },
        }
        choice = {"index": {"type": "integer"}, "delta": delta, "finish_reason": _FINISH}
    else:
        choice = {"index": {"type": "integer"}, "text": {"type": "string"}}
        choice["finish_reason"] = _FINISH
    choice["logprobs"] = _LOGPROBS
    return {
        "type": "object",
        "required": ["id", "object", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion.chunk" if chat else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "properties": choice}},
            "usage": {"anyOf": [_USAGE, {"type": "null"}]},
        },
    }


def _event(chat: bool) -> dict:
    """One server-sent event (OpenAPI 3.1: a text/event-stream schema describes each event):
    its data is a JSON chunk, an error object (the stream's last before [DONE]) or [DONE]."""
    name = "ChatCompletionChunk" if chat else "CompletionChunk"
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [
                {"$ref": f"#/components/schemas/{name}"},
                {"$ref": "#/components/schemas/Error"},
            ]
        },
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"const": "message"},
            "data": {"if": {"const": "[DONE]"}, "then": True, "else": json_data},
        },
    }


_TOKENIZED = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": "array", "items": {"type": ["string", "null"]}},
    },
}
_DETOKENIZED = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}
_VERSION = {
    "type": "object",
    "required": ["version"],
    "properties": {"version": {"type": "string"}},
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _post(summary: str, request: dict, reply: dict) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": reply}}},
                **_errors("400", "401", "404", "413", "429"),
            },
        }
    }


def _get(summary: str, reply: dict) -> dict:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": reply}}},
                **_errors("401"),
            },
        }
    }


def _errors(*codes: str) -> dict:
    return {
        c: {
            "description": _ERRORS[c],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for c in codes
    }


def _generate_op(endpoint: str, summary: str) -> dict:
    chat = endpoint == oai.CHAT
    name = "ChatCompletion" if chat else "Completion"
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{name}Request"}}
                },
            },
            "responses": {
                "200": {
                    "description": "The completion; with `stream: true`, server-sent events "
                    "(`data: {chunk}` lines, then `data: [DONE]`). An error after the stream "
                    'started comes as a last `data: {"error": ...}` event.',
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}},
                        "text/event-stream": {"schema": _event(chat)},
                    },
                },
                **_errors("400", "401", "404", "413", "429", "500", "503", "504"),
            },
        }
    }


def openapi_document(model: str) -> dict:
    """The document; `model` is the served model's name (used in examples)."""
    model_schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "example": model},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {
                "type": "integer",
                "description": "The longest prompt + output a request may have (tokens)",
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "DistServe mesh: OpenAI-compatible API",
            "version": "1",
            "description": "Completions and chat completions over a prefill/decode-"
            "disaggregated mesh. Errors have OpenAI's shape: "
            '{"error": {"message", "type", "param", "code"}}.',
        },
        "paths": {
            "/v1/completions": _generate_op(oai.COMPLETIONS, "Complete a prompt"),
            "/v1/chat/completions": _generate_op(oai.CHAT, "Answer a conversation"),
            "/v1/models": {
                "get": {
                    "summary": "The served models",
                    "responses": {
                        "200": {
                            "description": "A list of models",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "properties": {
                                            "object": {"const": "list"},
                                            "data": {"type": "array", "items": model_schema},
                                        },
                                    }
                                }
                            },
                        },
                        **_errors("401"),
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One served model",
                    "parameters": [_MODEL_PATH_PARAM],
                    "responses": {
                        "200": {
                            "description": "The model",
                            "content": {"application/json": {"schema": model_schema}},
                        },
                        **_errors("401", "404"),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Whether a request can be served now (never needs an API key)",
                    "responses": {
                        "200": {
                            "description": "Serving: the mode and the live workers per role",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        **_errors("503"),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {"200": {"description": "OpenAPI 3.1"}},
                }
            },
            "/tokenize": _post(
                "Tokenize a prompt as /v1/completions does, or messages as /v1/chat/completions "
                "renders them (vLLM's shape; no context limit applies)",
                {"oneOf": [_ref("TokenizeRequest"), _ref("TokenizeChatRequest")]},
                _TOKENIZED,
            ),
            "/detokenize": _post("Token ids to text", _ref("DetokenizeRequest"), _DETOKENIZED),
            "/version": _get("The server's version", _VERSION),
            "/metrics": {
                "get": {
                    "summary": "The gateway's Prometheus metrics (404 when its metrics are off)",
                    "responses": {
                        "200": {
                            "description": "Prometheus text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        **_errors("401", "404"),
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "CompletionRequest": _request_schema(oai.COMPLETIONS),
                "ChatCompletionRequest": _request_schema(oai.CHAT),
                "TokenizeRequest": _request_schema(fields.TOKENIZE),
                "TokenizeChatRequest": _request_schema(fields.TOKENIZE_CHAT),
                "DetokenizeRequest": _request_schema(fields.DETOKENIZE),
                "Completion": _completion_reply(chat=False),
                "ChatCompletion": _completion_reply(chat=True),
                "CompletionChunk": _chunk(chat=False),
                "ChatCompletionChunk": _chunk(chat=True),
                "Error": _ERROR,
            },
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"apiKey": []}],
    }
