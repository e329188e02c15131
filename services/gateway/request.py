"""Validation of a Generate request into a domain object: everything checked before routing."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from services.common.convert import sampling_from_pb
from services.common.errors import InvalidRequest
from services.common.model_config import ModelConfig
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer

MAX_REQUEST_ID_CHARS = 128
MAX_PROMPT_CHARS = 4 * 2**20


@dataclass(frozen=True)
class Request:
    """A validated request: token ids, parameters and a deadline (monotonic seconds or None)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


@dataclass(frozen=True)
class Limits:
    """What this gateway accepts; defaults come from the model's context."""

    max_context: int
    vocab_size: int
    max_tokens: int  # largest max_tokens a request may ask for

    @classmethod
    def for_model(cls, model: ModelConfig, max_tokens: int | None = None) -> Limits:
        return cls(
            max_context=model.max_position_embeddings,
            vocab_size=model.vocab_size,
            max_tokens=max_tokens or model.max_position_embeddings,
        )


def validate(pb, tokenizer: Tokenizer, limits: Limits, grpc_remaining: float | None) -> Request:
    """Check a GenerateRequest; InvalidRequest with an actionable message if anything is off."""
    kind = pb.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("give a prompt: `text` or `token_ids`")
    if kind == "text":
        if not pb.text:
            raise InvalidRequest("prompt is empty: give at least one character")
        if len(pb.text) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"prompt text is longer than {MAX_PROMPT_CHARS} characters")
        ids = tokenizer.encode(pb.text)
    else:
        ids = list(pb.token_ids.ids)
        if not ids:
            raise InvalidRequest("prompt is empty: give at least one token id")
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})"
            )
    params = sampling_from_pb(pb.sampling)
    if params.max_tokens > limits.max_tokens:
        raise InvalidRequest(
            f"max_tokens is {params.max_tokens}; this server allows at most {limits.max_tokens}"
        )
    if len(ids) >= limits.max_context:
        raise InvalidRequest(
            f"prompt has {len(ids)} tokens; the model's context is {limits.max_context} tokens, "
            "shorten the prompt"
        )
    room = limits.max_context - len(ids)
    if params.max_tokens > room:
        raise InvalidRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {limits.max_context} tokens; set max_tokens <= {room}"
        )
    for t in params.stop_token_ids:
        if t >= limits.vocab_size:
            raise InvalidRequest(f"stop token id {t} is outside the vocabulary")
    request_id = pb.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest(
            f"request_id must be printable and at most {MAX_REQUEST_ID_CHARS} characters"
        )
    budgets = [s for s in (grpc_remaining, pb.timeout_ms / 1000 if pb.timeout_ms else None) if s]
    deadline = time.monotonic() + min(budgets) if budgets else None
    return Request(request_id, ids, params, deadline)
