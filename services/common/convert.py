"""Protobuf <-> domain objects, at the servicer boundary."""

from __future__ import annotations

from collections.abc import Iterable

from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import common_pb2
from services.common.generation_defaults import GenerationDefaults
from services.common.logprobs import TokenLogprobs
from services.common.sampling import FinishReason, SamplingParams
from services.common.structured_output import GuideKind, StructuredOutput

DEFAULT_MAX_TOKENS = 16

_FINISH_TO_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def sampling_from_pb(
    pb: common_pb2.SamplingParams, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    """Validated SamplingParams (InvalidRequest on bad values). Unset fields take `defaults`
    (the model's generation_config.json, at the gateway) where it sets them, else the
    contract's: greedy, top_p 1, top_k off."""
    d = defaults or GenerationDefaults()
    return SamplingParams(
        max_tokens=pb.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=_given(pb, "temperature", d.temperature, 0.0),
        top_p=_given(pb, "top_p", d.top_p, 1.0),
        top_k=_given(pb, "top_k", d.top_k, 0),
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        include_stop_str_in_output=pb.include_stop_str_in_output,
        skip_special_tokens=pb.skip_special_tokens if pb.HasField("skip_special_tokens") else True,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        repetition_penalty=_given(pb, "repetition_penalty", d.repetition_penalty, 1.0),
        min_p=_given(pb, "min_p", d.min_p, 0.0),
        min_tokens=pb.min_tokens,
        logit_bias=dict(pb.logit_bias),
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
        n=pb.n if pb.HasField("n") else 1,
        best_of=pb.best_of if pb.HasField("best_of") else None,
        structured_output=(
            structured_from_pb(pb.structured_output) if pb.HasField("structured_output") else None
        ),
    )


def structured_from_pb(pb: common_pb2.StructuredOutput) -> StructuredOutput:
    """A validated StructuredOutput (InvalidRequest naming `structured_output` if not)."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(
            "structured_output sets no kind: give json_schema, json_object, regex, choice or "
            "grammar",
            param="structured_output",
        )
    if kind == "json_object" and not pb.json_object:
        raise InvalidRequest(
            "structured_output.json_object must be true (unset structured_output for free text)",
            param="structured_output",
        )
    spec: str | tuple[str, ...] = {
        "json_schema": lambda: pb.json_schema,
        "json_object": lambda: "",
        "regex": lambda: pb.regex,
        "choice": lambda: tuple(pb.choice.choices),
        "grammar": lambda: pb.grammar,
    }[kind]()
    return StructuredOutput(
        _KIND_FROM_PB[kind],
        spec,
        any_whitespace=not pb.disable_any_whitespace,
        replay_tokens=pb.replay_tokens,
    )


def structured_to_pb(s: StructuredOutput) -> common_pb2.StructuredOutput:
    pb = common_pb2.StructuredOutput(
        disable_any_whitespace=not s.any_whitespace, replay_tokens=s.replay_tokens
    )
    if s.kind is GuideKind.JSON:
        pb.json_schema = s.spec
    elif s.kind is GuideKind.JSON_OBJECT:
        pb.json_object = True
    elif s.kind is GuideKind.REGEX:
        pb.regex = s.spec
    elif s.kind is GuideKind.CHOICE:
        pb.choice.choices.extend(s.spec)
    else:
        pb.grammar = s.spec
    return pb


_KIND_FROM_PB = {
    "json_schema": GuideKind.JSON,
    "json_object": GuideKind.JSON_OBJECT,
    "regex": GuideKind.REGEX,
    "choice": GuideKind.CHOICE,
    "grammar": GuideKind.GRAMMAR,
}


def _given(pb: common_pb2.SamplingParams, name: str, default: float | None, neutral: float):
    if pb.HasField(name):
        return getattr(pb, name)
    return neutral if default is None else default


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        logit_bias=dict(p.logit_bias),
    )
    if p.seed is not None:
        pb.seed = p.seed
    if p.repetition_penalty != 1.0:
        pb.repetition_penalty = p.repetition_penalty
    if p.logprobs is not None:
        pb.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        pb.prompt_logprobs = p.prompt_logprobs
    if p.n != 1:
        pb.n = p.n
    if p.best_of is not None:
        pb.best_of = p.best_of
    if p.structured_output is not None:
        pb.structured_output.CopyFrom(structured_to_pb(p.structured_output))
    return pb


def logprobs_to_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_token_ids=lp.top_ids,
        top_logprobs=lp.top_logprobs,
    )


def logprobs_from_pb(pb: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        pb.token_id, pb.logprob, pb.rank, tuple(pb.top_token_ids), tuple(pb.top_logprobs)
    )


def logprobs_list_to_pb(lps: Iterable[TokenLogprobs] | None) -> list[common_pb2.TokenLogprobs]:
    return [logprobs_to_pb(lp) for lp in lps or ()]


def logprobs_list_from_pb(pbs: Iterable[common_pb2.TokenLogprobs]) -> tuple[TokenLogprobs, ...]:
    return tuple(logprobs_from_pb(pb) for pb in pbs)


def finish_to_pb(reason: FinishReason | None) -> int:
    return _FINISH_TO_PB.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED)


def finish_from_pb(value: int) -> FinishReason | None:
    return _FINISH_FROM_PB.get(value)
