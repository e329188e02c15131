"""Sampling parameters of one request, validated without the model runtime."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from services.common.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 2**32 - 1  # the protobuf field is a uint32


class FinishReason(enum.StrEnum):
    """Why a request stopped."""

    LENGTH = "length"  # max_tokens reached, or the model's context is full
    STOP = "stop"  # EOS, a stop token id, or a stop string
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. A seed makes sampling
    reproducible for the same prompt and parameters. Generation stops at max_tokens, at an EOS
    token (unless ignore_eos), at any of stop_token_ids, or when the text contains a stop string
    (the stop string itself is not returned).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequest(
                f"max_tokens must be an integer, got {self.max_tokens!r}", param="max_tokens"
            )
        if self.max_tokens <= 0:
            raise InvalidRequest(
                f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens"
            )
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise InvalidRequest(
                f"temperature must be a finite number, got {self.temperature!r}",
                param="temperature",
            )
        if self.temperature < 0:
            raise InvalidRequest(
                f"temperature must be >= 0 (0 is greedy), got {self.temperature}",
                param="temperature",
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not 0 <= self.top_k <= MAX_TOP_K
        ):
            raise InvalidRequest(
                f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it; a k past the "
                f"vocabulary keeps every token), got {self.top_k!r}",
                param="top_k",
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise InvalidRequest(
                f"seed must be an integer in [0, 2**63), got {self.seed!r}", param="seed"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", param="stop"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(
                    f"stop strings must be non-empty strings, got {s!r}", param="stop"
                )
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(s)}",
                    param="stop",
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
                param="stop_token_ids",
            )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequest(
                    f"stop_token_ids must be integers >= 0, got {t!r}", param="stop_token_ids"
                )


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
