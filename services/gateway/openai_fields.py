"""Every request field this server knows, and what it does with each: one table.

FIELDS lists each field of OpenAI's API and of vLLM's (the server people move here from) for the
endpoints that take request bodies, with its status:

- **honoured**: the field does what OpenAI's or vLLM's documentation says; `kind` is its JSON
  type, checked here (ranges are SamplingParams' and build_request's, shared with gRPC);
- **refused unless default**: this server cannot do what the field asks, so any value but the
  harmless ones in `defaults` (which change nothing, e.g. `n: 1`, `logprobs: false`) is a 400
  naming the field, saying why and what to do instead.

A field in neither list is refused too, naming the field meant when the name is close to one
(`temprature`: did you mean `temperature`?), and so is a field of another endpoint. `null` is the
same as unset for every field. A 200 means every field sent did what it says; none is dropped.

The parser (openai_protocol.py), the OpenAPI document (openapi.py) and the table in docs/api.md
(`python -m services.gateway.openai_fields`) are all written from FIELDS.

Why one file over ~300 lines: it is one table, one entry per field.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.logprobs import MAX_LOGPROBS
from services.common.sampling import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
)
from services.gateway.chat_template import ROLES

COMPLETIONS, CHAT = "completions", "chat"
TOKENIZE, TOKENIZE_CHAT, DETOKENIZE = "tokenize", "tokenize_chat", "detokenize"
BOTH = (COMPLETIONS, CHAT)
PATHS = {
    COMPLETIONS: "/v1/completions",
    CHAT: "/v1/chat/completions",
    TOKENIZE: "/tokenize (with a prompt)",
    TOKENIZE_CHAT: "/tokenize (with messages)",
    DETOKENIZE: "/detokenize",
}
OPENAI, VLLM, VLLM_OLD, OURS = "OpenAI", "vLLM", "vLLM (older versions)", "DistServe"


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
LOGPROBS_K = Kind(
    lambda x: _is_int(x) or x is False,
    {"oneOf": [{"type": "integer"}, {"const": False}]},
    "an integer (or false: none)",
)
NUMBER = Kind(_is_number, {"type": "number"}, "a number")
BOOL = Kind(lambda x: isinstance(x, bool), {"type": "boolean"}, "true or false")
STRING = Kind(lambda x: isinstance(x, str), {"type": "string"}, "a string")
OBJECT = Kind(lambda x: isinstance(x, dict), {"type": "object"}, "an object")
STOP = Kind(
    lambda x: isinstance(x, str) or (isinstance(x, list) and all(isinstance(s, str) for s in x)),
    {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "a string or an array of strings",
)
STRINGS = Kind(
    lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x),
    {"type": "array", "items": {"type": "string"}},
    "an array of strings",
)
GUIDED_JSON = Kind(
    lambda x: isinstance(x, dict | str),
    {"oneOf": [{"type": "object"}, {"type": "string"}]},
    "a JSON schema (an object, or its JSON text)",
)
RESPONSE_FORMAT = Kind(
    lambda x: isinstance(x, dict),
    {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["schema"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
    },
    'an object such as {"type": "json_object"}',
)
TOKEN_IDS = Kind(
    _is_token_ids, {"type": "array", "items": {"type": "integer"}}, "an array of integers"
)
DOCUMENTS = Kind(
    lambda x: (
        isinstance(x, list)
        and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in x)
    ),
    {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "string"}}},
    'an array of objects of strings (e.g. {"title": ..., "text": ...})',
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
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_TOOL_CALL = {  # an assistant message's call, as the reply gave it
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
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
                        {"type": "array", "items": _TEXT_PART},
                        {"type": "null"},
                    ]
                },
                "name": {"type": ["string", "null"]},
                "tool_calls": {"type": "array", "items": _TOOL_CALL},
                "tool_call_id": {"type": "string"},
            },
        },
    },
    "an array of message objects",
)
_FUNCTION_NAME = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}},
}
TOOLS = Kind(
    lambda x: isinstance(x, list),
    {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    **_FUNCTION_NAME,
                    "properties": {
                        **_FUNCTION_NAME["properties"],
                        "description": {"type": "string"},
                        "parameters": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                },
            },
        },
    },
    'an array of {"type": "function", "function": {"name": ..., "parameters": ...}}',
)
TOOL_CHOICE = Kind(
    lambda x: x in ("none", "auto", "required") or isinstance(x, dict),
    {
        "oneOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {"type": {"const": "function"}, "function": _FUNCTION_NAME},
            },
        ]
    },
    '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
)


@dataclass(frozen=True)
class Field:
    """One request field of some endpoints: honoured (`kind` set) or refused unless it holds
    one of `defaults`. `about` says what an honoured field does, or why a refused one is
    refused and what to do instead."""

    name: str
    endpoints: tuple[str, ...]
    about: str
    origin: str
    kind: Kind | None = None
    defaults: tuple = ()
    required: bool = False
    extra: dict | None = None  # more JSON schema (ranges, defaults) for the document

    @property
    def honoured(self) -> bool:
        return self.kind is not None

    def accepts(self, value: object) -> bool:
        """A refused field's value that changes nothing: null or one of its defaults."""
        return value is None or any(_same(value, d) for d in self.defaults)


def _same(value: object, default: object) -> bool:
    """JSON equality: 0 == 0.0, but false is not 0 and 1 is not true."""
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    if _is_number(value) and _is_number(default):
        return value == default
    return type(value) is type(default) and value == default


def _h(name, endpoints, about, kind, origin=OPENAI, **kw) -> Field:
    return Field(name, endpoints, about, origin, kind=kind, **kw)


def _r(name, endpoints, about, defaults=(), origin=OPENAI) -> Field:
    return Field(name, endpoints, about, origin, defaults=defaults)


_C, _H = (COMPLETIONS,), (CHAT,)
_RENDER = (CHAT, TOKENIZE_CHAT)  # what renders messages with the chat template
_OLD_FUNCTIONS = "OpenAI's deprecated form of tools; send `tools` and `tool_choice`"

FIELDS: tuple[Field, ...] = (
    # The prompt ------------------------------------------------------------------------------
    _h("model", (*BOTH, TOKENIZE, TOKENIZE_CHAT, DETOKENIZE),
       "A model from GET /v1/models (another name: 404); omitted: the served model.", STRING),
    _h("prompt", _C, "The prompt: text, or token ids. One prompt per request.", PROMPT,
       required=True),
    _h("prompt", (TOKENIZE,), "The text to tokenize.", STRING, VLLM, required=True),
    _h("messages", _RENDER,
       "The conversation, rendered with the model's chat template (text content only).",
       MESSAGES, required=True),
    _h("tokens", (DETOKENIZE,), "The token ids to turn into text.", TOKEN_IDS, VLLM,
       required=True),
    _r("suffix", _C, "this server does not fill in text before a suffix; send the prompt "
       "alone", ("",)),
    _r("prompt_embeds", _C, "prompts as embeddings are not supported; send text or token ids",
       origin=VLLM),
    # How much to generate --------------------------------------------------------------------
    _h("max_tokens", BOTH,
       "Most tokens to generate. Default: 16 for completions; for chat, the rest of the context.",
       INT, extra={"minimum": 1}),
    _h("max_completion_tokens", _H, "The same as max_tokens (OpenAI's newer name); wins when "
       "both are set.", INT, extra={"minimum": 1}),
    _h("max_completion_tokens", _C, "The same as max_tokens, as on chat; wins when both are "
       "set.", INT, OURS, extra={"minimum": 1}),
    _h("stop", BOTH, "Up to 16 strings (each up to 256 characters) that end generation; the "
       "returned text stops before the first one.", STOP),
    _h("stop_token_ids", BOTH, "Token ids that end generation (up to 64).", TOKEN_IDS, VLLM),
    _h("ignore_eos", BOTH, "Keep generating past the end-of-sequence token.", BOOL, VLLM),
    _h("min_tokens", BOTH, "EOS, stop_token_ids and stop strings do not end generation before "
       "this many tokens (at most max_tokens).", INT, VLLM, extra={"minimum": 0, "default": 0}),
    _h("include_stop_str_in_output", BOTH, "Keep the stop string that ended the text at its "
       "end.", BOOL, VLLM),
    # Sampling --------------------------------------------------------------------------------
    _h("temperature", BOTH, "0 is greedy; higher samples more freely.", NUMBER,
       extra={"minimum": 0, "default": 1}),
    _h("top_p", BOTH, "Nucleus sampling: keep the most likely tokens up to this probability "
       "mass.", NUMBER, extra={"exclusiveMinimum": 0, "maximum": 1, "default": 1}),
    _h("top_k", BOTH, "Keep only the k most likely tokens; 0 or -1 is off.", INT, VLLM,
       extra={"minimum": -1, "maximum": MAX_TOP_K, "default": 0}),
    _h("seed", BOTH, "Reproducible sampling: same prompt, parameters and seed give the same "
       "tokens.", INT, extra={"minimum": 0, "maximum": 2**63 - 1}),
    _h("presence_penalty", BOTH, "Subtracted once from the logit of each token the output "
       "already holds (the prompt does not count).", NUMBER,
       extra={"minimum": -2, "maximum": 2, "default": 0}),
    _h("frequency_penalty", BOTH, "Subtracted from a token's logit once per time the output "
       "already holds it.", NUMBER, extra={"minimum": -2, "maximum": 2, "default": 0}),
    _h("repetition_penalty", BOTH, "A seen token's (prompt or output) logit is divided by it "
       "when positive, multiplied when negative; > 1 discourages repeats.", NUMBER, VLLM,
       extra={"minimum": MIN_REPETITION_PENALTY, "maximum": MAX_REPETITION_PENALTY,
              "default": 1}),
    _h("min_p", BOTH, "Sample only tokens at least min_p times as likely as the most likely "
       "one.", NUMBER, VLLM, extra={"minimum": 0, "maximum": 1, "default": 0}),
    _h("logit_bias", BOTH, "Token id (a string key) -> bias in [-100, 100] added to its logit "
       "(up to 1024 ids of the vocabulary).", OBJECT,
       extra={"propertyNames": {"pattern": "^[0-9]{1,20}$"},
              "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
              "maxProperties": MAX_LOGIT_BIAS_ENTRIES}),
    _r("allowed_token_ids", BOTH, "restricting the vocabulary is not supported", origin=VLLM),
    _r("bad_words", _H, "banning words is not supported", ([],), VLLM),
    _r("logits_processors", BOTH, "custom logits processors are not loaded by this server",
       origin=VLLM),
    _h("n", BOTH, f"How many choices to return (1..{MAX_N}): the prompt is prefilled once and "
       "its KV shared by the choices; choice i samples from seed + i.", INT,
       extra={"minimum": 1, "maximum": MAX_N, "default": 1}),
    _h("best_of", _C, f"How many choices to generate (n..{MAX_N}), of which the n of highest "
       "cumulative log-probability are returned, best first; not with stream.", INT, VLLM,
       extra={"minimum": 1, "maximum": MAX_N}),
    _r("use_beam_search", BOTH, "beam search is not supported", (False,), VLLM),
    _r("length_penalty", BOTH, "it applies to beam search, which is not supported", (1,), VLLM),
    _r("max_repetition_pattern_size", BOTH, "stopping at repeated patterns is not supported",
       (0,), VLLM),
    _r("min_repetition_pattern_size", BOTH, "stopping at repeated patterns is not supported",
       (0,), VLLM),
    _r("repetition_min_count", BOTH, "stopping at repeated patterns is not supported", (0,),
       VLLM),
    # What the reply carries ------------------------------------------------------------------
    _h("stream", BOTH, "Stream server-sent events, ending with `data: [DONE]`.", BOOL),
    _h("stream_options", BOTH, 'With `stream: true`: `{"include_usage": true}` adds a last chunk '
       "with `usage` (`usage: null` on the others); with `\"continuous_usage_stats\": true` "
       "too, every chunk carries the usage so far. `include_obfuscation` only as false.",
       OBJECT),
    _h("echo", _C, "Prepend the prompt (its text; token ids: their decoded text) to the "
       "completion.", BOOL),
    _h("echo", _H, "When the last message is the assistant's (a reply to continue), prepend "
       "its content to the answer.", BOOL, VLLM),
    _h("return_token_ids", BOTH, "Add `token_ids` (generated) to each choice or chunk and "
       "`prompt_token_ids` (to the choice for completions, the reply for chat; the first "
       "chunk when streaming).", BOOL, VLLM),
    _h("request_id", BOTH, "The request's id (at most 128 printable characters): the reply's "
       "`id` is `cmpl-`/`chatcmpl-` + it. Wins over the `x-request-id` header.", STRING, VLLM),
    _h("logprobs", _C, "Each token's log-probability and the k most likely tokens' at its "
       f"position (0..{MAX_LOGPROBS}; false: none); with echo, the prompt's too. The model's "
       "raw distribution, before temperature and penalties.", LOGPROBS_K,
       extra={"minimum": 0, "maximum": MAX_LOGPROBS}),
    _h("logprobs", _H, "Each token's log-probability (in `choices[].logprobs.content`); the "
       "model's raw distribution, before temperature and penalties.", BOOL),
    _h("top_logprobs", _H, f"With logprobs: true, the k most likely tokens (0..{MAX_LOGPROBS}) "
       "at each position.", INT, extra={"minimum": 0, "maximum": MAX_LOGPROBS}),
    _h("prompt_logprobs", BOTH, "Each prompt token's log-probability and the k most likely "
       f"tokens' (0..{MAX_LOGPROBS}), in `prompt_logprobs` (the first token's is null); the "
       "prompt is then computed whole, past the prefix cache.", INT, VLLM,
       extra={"minimum": 0, "maximum": MAX_LOGPROBS}),
    _h("return_tokens_as_token_ids", BOTH, "Write logprobs' tokens as `token_id:<id>`.", BOOL,
       VLLM),
    _h("skip_special_tokens", BOTH, "false: write special tokens (e.g. <|im_end|>) into the "
       "text; default true.", BOOL, VLLM),
    _r("spaces_between_special_tokens", BOTH, "special tokens are spaced as the model's tokenizer "
       "decodes them (vLLM applies this to slow tokenizers only)", (True,), VLLM),
    _r("modalities", _H, "this server answers with text only", (["text"],)),
    _r("audio", _H, "this server answers with text only"),
    # Tokenization and the chat template ------------------------------------------------------
    _h("add_special_tokens", (*BOTH, TOKENIZE, TOKENIZE_CHAT), "Add the tokenizer's special "
       "tokens (e.g. BOS) to the prompt. Default: true for a prompt, false for messages (the "
       "chat template writes its own).", BOOL, VLLM),
    _h("truncate_prompt_tokens", BOTH, "Keep only the prompt's last k tokens; -1: as many as "
       "fit the context with max_tokens.", INT, VLLM,
       extra={"oneOf": [{"const": -1}, {"minimum": 1}]}),
    _h("add_generation_prompt", _RENDER, "Passed to the chat template (default true): open "
       "the assistant's turn.", BOOL, VLLM),
    _h("continue_final_message", _RENDER, "Render the last message open-ended (no end of "
       "turn), so the model continues it; excludes add_generation_prompt.", BOOL, VLLM),
    _h("chat_template_kwargs", _RENDER, "More variables for the chat template (e.g. "
       '`{"enable_thinking": false}`), as transformers\' apply_chat_template takes them; '
       "names of the template's own variables are refused.", OBJECT, VLLM),
    _h("documents", _RENDER, "Documents for retrieval-augmented templates: the template's "
       "`documents` variable.", DOCUMENTS, VLLM),
    _h("return_token_strs", (TOKENIZE, TOKENIZE_CHAT), "Add `token_strs`: each token's text "
       "in the vocabulary.", BOOL, VLLM),
    _r("chat_template", (*_RENDER,), "this server renders with the model's own chat template "
       "(its tokenizer_config.json); a per-request template is not accepted", origin=VLLM),
    _r("mm_processor_kwargs", (*_RENDER,), "multimodal input is not supported", origin=VLLM),
    _h("tools", _RENDER, "Functions the model may call: the chat template's `tools` "
       "variable. With tool_choice `auto` the answer is read by the gateway's "
       "`--tool-call-parser` into `message.tool_calls` (without a parser: a 400).", TOOLS),
    _h("tool_choice", _H, "`auto` (the default with tools): the model decides, its calls "
       "are parsed; `none`: tools reach the template, the answer is text; `required`: the "
       "answer is constrained to calls of the tools (one or more, see parallel_tool_calls); "
       "a named function: to one call of it.", TOOL_CHOICE),
    _h("parallel_tool_calls", _H, "Default true. False: at most one call: `required` is "
       "constrained to exactly one, `auto` returns the model's first call only (as vLLM).",
       BOOL),
    _r("functions", _H, _OLD_FUNCTIONS, ([],)),
    _r("function_call", _H, _OLD_FUNCTIONS, ("none", "auto")),
    _r("reasoning_effort", _H, "this server has no reasoning control; a template variable for "
       'it goes in chat_template_kwargs (e.g. {"reasoning_effort": "low"})'),
    _r("include_reasoning", _H, "no reasoning parser separates reasoning from the answer",
       (True,), VLLM),
    _r("verbosity", _H, "this server has no verbosity control", ("medium",)),
    _r("web_search_options", _H, "this server does not search the web"),
    _r("prediction", _H, "predicted outputs are not supported"),
    # Structured output -----------------------------------------------------------------------
    _h("response_format", BOTH, '`{"type": "json_object"}`: the answer is a JSON object; '
       '`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`: a JSON value '
       "valid against `schema` (enforced while sampling, whatever `strict` says); "
       '`{"type": "text"}`: free text. The request ends (`stop`) once the answer is complete.',
       RESPONSE_FORMAT),
    _h("structured_outputs", BOTH, "One constraint on the answer: `json` (a schema), `regex`, "
       "`choice` (strings), `grammar` (Lark or GBNF) or `json_object: true`; with "
       "`disable_any_whitespace` (JSON: no whitespace beyond the separators'). "
       "`disable_fallback` holds either way (one grammar engine, no fallback).", OBJECT, VLLM),
    _h("guided_json", BOTH, "The answer is JSON valid against this schema (an object, or its "
       "JSON text).", GUIDED_JSON, VLLM_OLD),
    _h("guided_regex", BOTH, "The answer matches this regular expression (Rust regex syntax).",
       STRING, VLLM_OLD),
    _h("guided_choice", BOTH, "The answer is exactly one of these strings.", STRINGS,
       VLLM_OLD),
    _h("guided_grammar", BOTH, "The answer follows this context-free grammar (Lark, or GBNF "
       "as `root ::= ...`).", STRING, VLLM_OLD),
    _r("guided_decoding_backend", BOTH, "this server's grammar engine is llguidance (vLLM's "
       "`guidance`); no other is loaded", ("auto", "guidance"), VLLM_OLD),
    _r("guided_whitespace_pattern", BOTH, "a custom whitespace pattern is not supported; "
       "`structured_outputs.disable_any_whitespace` allows none beyond the separators'",
       origin=VLLM_OLD),
    _r("structural_tag", _H, "structural tags (grammars triggered inside free text) are not "
       "supported yet", origin=VLLM_OLD),
    # Serving ---------------------------------------------------------------------------------
    _h("user", BOTH, "An end-user id, written to the gateway's log.", STRING),
    _h("safety_identifier", _H, "An end-user id (OpenAI's successor of `user`), written to the "
       "gateway's log.", STRING),
    _r("priority", BOTH, "this server schedules requests first come, first served", (0,), VLLM),
    _r("service_tier", _H, "this server has one service tier", ("auto", "default")),
    _r("store", _H, "this server stores no completions", (False,)),
    _r("metadata", _H, "it is kept with stored completions, and this server stores none",
       ({},)),
    _r("prompt_cache_key", _H, "this server routes by the prompt's cached prefix itself; leave "
       "it unset"),
    _r("prompt_cache_retention", _H, "this server's prefix cache keeps prompts while it has "
       "room; leave it unset"),
    _r("cache_salt", BOTH, "salting the prefix cache is not supported", origin=VLLM),
    _r("kv_transfer_params", BOTH, "the mesh moves KV between its own instances; it takes no "
       "KV from outside", origin=VLLM),
    _r("vllm_xargs", BOTH, "no extension reads extra arguments here", origin=VLLM),
)  # fmt: skip

BY_ENDPOINT: dict[str, dict[str, Field]] = {
    e: {f.name: f for f in FIELDS if e in f.endpoints} for e in PATHS
}


def checked(endpoint: str, body: object) -> dict[str, object]:
    """The honoured fields of `body` that are set (not null), type-checked. InvalidRequest,
    naming the field, for a missing required field, a field of the wrong type, a refused field
    not at its default, and a field this endpoint does not know."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    fields = BY_ENDPOINT[endpoint]
    for f in fields.values():
        if f.required and body.get(f.name) is None:
            raise InvalidRequest(f"'{f.name}' is required", param=f.name)
    values = {}
    for name, value in body.items():
        if value is None:
            continue  # null is unset, for any field
        f = fields.get(name)
        if f is None:
            raise _unknown(endpoint, name)
        if not f.honoured:
            if not f.accepts(value):
                raise InvalidRequest(_refusal(f, value), param=name)
        elif not f.kind.check(value):
            raise InvalidRequest(f"'{name}' must be {f.kind.words}, got {show(value)}", param=name)
        else:
            values[name] = value
    return values


def _refusal(f: Field, value: object) -> str:
    only = " or ".join(json.dumps(d) for d in f.defaults)
    leave = f"leave it unset or send {only}" if only else "leave it unset"
    return f"'{f.name}' = {show(value)} is not supported: {f.about} ({leave})"


def _unknown(endpoint: str, name: str) -> InvalidRequest:
    elsewhere = [PATHS[e] for e in PATHS if e != endpoint and name in BY_ENDPOINT[e]]
    if elsewhere:
        return InvalidRequest(
            f"'{name}' is a field of {' and '.join(elsewhere)}, not of {PATHS[endpoint]}",
            param=name,
        )
    close = difflib.get_close_matches(name, BY_ENDPOINT[endpoint], n=1, cutoff=0.75)
    hint = (
        f"did you mean '{close[0]}'?"
        if close
        else "this server refuses fields it does not know rather than ignore them "
        "(GET /openapi.json lists every field)"
    )
    return InvalidRequest(f"'{name}' is not a field of {PATHS[endpoint]}: {hint}", param=name)


def show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def markdown_table() -> str:
    """The table of docs/api.md: every field of the generation endpoints, what it does or why
    it is refused."""
    rows = [
        "| field | endpoints | from | status | what it does, or why it is refused |",
        "|---|---|---|---|---|",
    ]
    for f in FIELDS:
        ends = [e for e in f.endpoints if e in BOTH]
        if not ends:
            continue
        where = "both" if len(ends) == 2 else ("completions" if ends == [COMPLETIONS] else "chat")
        if f.honoured:
            status = "honoured"
        else:
            only = ", ".join(f"`{json.dumps(d)}`" for d in f.defaults)
            status = f"refused unless {only or '`null`'}"
        about = f.about.replace("|", "\\|")
        rows.append(f"| `{f.name}` | {where} | {f.origin} | {status} | {about} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
