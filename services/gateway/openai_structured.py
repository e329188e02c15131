"""Structured output in the OpenAI and vLLM request fields: `response_format`, vLLM's
`structured_outputs`, and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`, read into the one `StructuredOutput` both APIs carry.

One constraint per request: two fields at once (or two kinds inside `structured_outputs`) are a
400 naming both, as vLLM refuses them. A spec that cannot compile is a 400 naming the field it
came in. The fields' types were checked by openai_fields.FIELDS; their contents are checked
here.
"""

from __future__ import annotations

import json

from services.common.errors import InvalidRequest
from services.common.structured_output import GuideKind, StructuredOutput
from services.gateway.openai_fields import show

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# structured_outputs' keys: the kinds, then the options (value: what is refused, and why).
SO_KINDS = {
    "json": GuideKind.JSON,
    "regex": GuideKind.REGEX,
    "choice": GuideKind.CHOICE,
    "grammar": GuideKind.GRAMMAR,
    "json_object": GuideKind.JSON_OBJECT,
}
SO_REFUSED = {
    "disable_additional_properties": (
        False,
        "schemas are enforced as written; set additionalProperties: false in the schema",
    ),
    "whitespace_pattern": (None, "a custom whitespace pattern is not supported"),
    "structural_tag": (None, "structural tags are not supported yet"),
}
SO_OPTIONS = {"disable_any_whitespace", "disable_fallback", *SO_REFUSED}
GUIDED = {
    "guided_json": GuideKind.JSON,
    "guided_regex": GuideKind.REGEX,
    "guided_choice": GuideKind.CHOICE,
    "guided_grammar": GuideKind.GRAMMAR,
}


def structured_output(values: dict[str, object]) -> StructuredOutput | None:
    """The constraint the checked fields `values` ask for, or None (free text)."""
    given: list[tuple[str, StructuredOutput]] = []
    if "response_format" in values:
        spec = _response_format(values["response_format"])
        if spec is not None:
            given.append(("response_format", spec))
    if "structured_outputs" in values:
        spec = _structured_outputs(values["structured_outputs"])
        if spec is not None:
            given.append(("structured_outputs", spec))
    for name, kind in GUIDED.items():
        if name in values:
            given.append((name, _spec(name, kind, values[name])))
    if len(given) > 1:
        names = " and ".join(f"'{n}'" for n, _ in given)
        raise InvalidRequest(
            f"{names} both constrain the answer; send one of them", param=given[1][0]
        )
    return given[0][1] if given else None


def _response_format(value: dict) -> StructuredOutput | None:
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InvalidRequest(
            f"'response_format.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got "
            f"{show(kind)}",
            param="response_format",
        )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _no_other_keys("response_format", value, allowed)
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", GuideKind.JSON_OBJECT, "")
    schema = value.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise InvalidRequest(
            "'response_format' of type json_schema needs 'json_schema': {\"name\": ..., "
            '"schema": {...}}',
            param="response_format",
        )
    _no_other_keys("response_format.json_schema", schema, JSON_SCHEMA_KEYS, "response_format")
    return _spec("response_format", GuideKind.JSON, schema["schema"])


def _structured_outputs(value: dict) -> StructuredOutput | None:
    _no_other_keys("structured_outputs", value, {*SO_KINDS, *SO_OPTIONS})
    for key, (default, why) in SO_REFUSED.items():
        if value.get(key) not in (None, default):
            raise InvalidRequest(
                f"'structured_outputs.{key}' is not supported: {why}", param="structured_outputs"
            )
    kinds = [k for k in SO_KINDS if value.get(k) not in (None, False)]
    if len(kinds) > 1:
        names = " and ".join(f"'structured_outputs.{k}'" for k in kinds)
        raise InvalidRequest(
            f"{names} both constrain the answer; send one of them", param="structured_outputs"
        )
    if not kinds:
        return None
    whitespace = value.get("disable_any_whitespace")
    if whitespace is not None and not isinstance(whitespace, bool):
        raise InvalidRequest(
            "'structured_outputs.disable_any_whitespace' must be true or false",
            param="structured_outputs",
        )
    # disable_fallback: there is one grammar engine and no fallback, so either value holds.
    key = kinds[0]
    spec = "" if key == "json_object" else value[key]
    if key == "json_object" and value[key] is not True:
        raise InvalidRequest(
            "'structured_outputs.json_object' must be true", param="structured_outputs"
        )
    return _spec("structured_outputs", SO_KINDS[key], spec, any_whitespace=not whitespace)


def _spec(
    field: str, kind: GuideKind, value: object, *, any_whitespace: bool = True
) -> StructuredOutput:
    """A StructuredOutput of `kind` from a field's value; InvalidRequest naming the field."""
    if kind is GuideKind.JSON and isinstance(value, dict):
        value = json.dumps(value)
    elif kind is GuideKind.CHOICE and isinstance(value, list):
        value = tuple(value)
    try:
        return StructuredOutput(kind, value, any_whitespace=any_whitespace)
    except InvalidRequest as e:
        raise InvalidRequest(f"'{field}': {e}", param=field) from None


def _no_other_keys(where: str, value: dict, allowed: set[str], param: str | None = None) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise InvalidRequest(
            f"'{where}' has no field {show(extra[0])}; it takes {', '.join(sorted(allowed))}",
            param=param or where,
        )
