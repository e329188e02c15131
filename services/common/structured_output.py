"""Structured output: what a request's answer must match, and its translation into a grammar of
the grammar engine (llguidance; docs/engine.md says why that one).

A `StructuredOutput` is one constraint: a JSON schema, any JSON object, a regular expression,
one of a list of strings, or a context-free grammar (Lark, or GBNF as vLLM's `guided_grammar`).
It is checked here, without a tokenizer, so the gateway refuses a schema that cannot compile
before any worker sees it; the engine compiles the same grammar text against the model's
tokenizer (services/engine/structured.py), so both sides read a spec the same way by
construction. No torch here (the gateway imports this), and llguidance is imported only when a
spec is checked.
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass

from services.common.errors import InvalidRequest

MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar (or all choices together)
MAX_CHOICES = 1024
PARAM = "structured_output"  # the gRPC field; the HTTP API names its own fields instead


class GuideKind(enum.StrEnum):
    """What kind of constraint a spec is (the names of vLLM's `structured_outputs` keys)."""

    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"  # a regular expression the whole answer matches (Rust regex syntax)
    CHOICE = "choice"  # exactly one of a list of strings
    GRAMMAR = "grammar"  # a context-free grammar: Lark (llguidance's), or GBNF (llama.cpp's)


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's answer.

    spec: the JSON schema as JSON text (JSON), the regex (REGEX), the grammar (GRAMMAR), the
    strings (CHOICE, a tuple); empty for JSON_OBJECT. any_whitespace: JSON answers may hold
    whitespace anywhere JSON allows it (vLLM's default); off, only the separators' single
    spaces. replay_tokens: the prompt's last tokens that are answer already generated under
    this constraint (a request moved to another instance mid-answer, or a client continuing a
    partial answer): the matcher reads them before sampling anything.
    """

    kind: GuideKind
    spec: str | tuple[str, ...] = ""
    any_whitespace: bool = True
    replay_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.spec, list):
            object.__setattr__(self, "spec", tuple(self.spec))
        self.validate()

    def validate(self) -> None:
        """InvalidRequest (param `structured_output`) when the spec is malformed or its grammar
        cannot compile (an unknown type, an unsatisfiable schema, a regex or grammar syntax
        error). A regex that no text matches is found only with the tokenizer, by the engine."""
        try:
            kind = GuideKind(self.kind)
        except ValueError:
            kinds = ", ".join(k.value for k in GuideKind)
            raise InvalidRequest(
                f"structured output kind must be one of {kinds}, got {self.kind!r}", param=PARAM
            ) from None
        object.__setattr__(self, "kind", kind)
        if (
            isinstance(self.replay_tokens, bool)
            or not isinstance(self.replay_tokens, int)
            or self.replay_tokens < 0
        ):
            raise InvalidRequest(
                f"replay_tokens must be an integer >= 0, got {self.replay_tokens!r}", param=PARAM
            )
        if not isinstance(self.any_whitespace, bool):
            raise InvalidRequest("any_whitespace must be true or false", param=PARAM)
        _check_shape(kind, self.spec)
        self.grammar()

    def grammar(self) -> str:
        """The llguidance grammar of this spec (InvalidRequest if it cannot compile)."""
        return _grammar(self.kind, self.spec, self.any_whitespace)

    def replayed(self, tokens: int) -> StructuredOutput:
        """The same constraint after `tokens` more answer tokens moved into the prompt."""
        return StructuredOutput(
            self.kind, self.spec, self.any_whitespace, self.replay_tokens + tokens
        )


def _check_shape(kind: GuideKind, spec: object) -> None:
    if kind is GuideKind.JSON_OBJECT:
        if spec != "":
            raise InvalidRequest("a json_object constraint takes no spec", param=PARAM)
        return
    if kind is GuideKind.CHOICE:
        if (
            not isinstance(spec, tuple)
            or not spec
            or not all(isinstance(c, str) and c for c in spec)
        ):
            raise InvalidRequest(
                "choice must be a non-empty list of non-empty strings", param=PARAM
            )
        if len(spec) > MAX_CHOICES:
            raise InvalidRequest(f"at most {MAX_CHOICES} choices, got {len(spec)}", param=PARAM)
        size = sum(len(c) for c in spec)
    elif not isinstance(spec, str) or not spec:
        raise InvalidRequest(f"a {kind.value} constraint needs a non-empty text", param=PARAM)
    else:
        size = len(spec)
    if size > MAX_SPEC_CHARS:
        raise InvalidRequest(
            f"the {kind.value} spec has {size} characters; at most {MAX_SPEC_CHARS}", param=PARAM
        )
    if kind is GuideKind.JSON:
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {e}", param=PARAM) from None
        if not isinstance(schema, dict):
            raise InvalidRequest("a JSON schema must be a JSON object", param=PARAM)


@functools.lru_cache(maxsize=256)
def _grammar(kind: GuideKind, spec: str | tuple[str, ...], any_whitespace: bool) -> str:
    """The llguidance grammar text of a (shape-checked) spec, validated without a tokenizer.
    Cached: a request's SamplingParams are rebuilt (and checked) at each hop."""
    import llguidance

    flexible = {"whitespace_flexible": any_whitespace}
    try:
        if kind is GuideKind.JSON:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=flexible)
        elif kind is GuideKind.JSON_OBJECT:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=flexible
            )
        elif kind is GuideKind.CHOICE:
            grammar = llguidance.grammar_from("choice", json.dumps(list(spec)))
        else:
            grammar = llguidance.grammar_from(kind.value, spec)
    except ValueError as e:
        raise InvalidRequest(f"the {kind.value} spec cannot be read: {e}", param=PARAM) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(
            f"the {kind.value} spec cannot be compiled: {error.strip()}", param=PARAM
        )
    return grammar
