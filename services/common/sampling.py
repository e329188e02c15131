"""Sampling parameters of one request, validated without the model runtime."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.logprobs import MAX_LOGPROBS
from services.common.structured_output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 2**32 - 1  # the protobuf field is a uint32
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # each bias lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024
# repetition_penalty's range: it travels and is applied as a float32, where values much further
# from 1 round to 0 or infinity (and would turn logits into infinities).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
MAX_N = 16  # n and best_of lie in [1, MAX_N]: each choice takes a decode seat and KV


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
    (the stop string itself is returned only with include_stop_str_in_output). The text skips
    special tokens unless skip_special_tokens is False.

    Logits processors (vLLM's and OpenAI's meanings; the order they apply in is sampler.py's):
    presence_penalty and frequency_penalty subtract `presence * (count > 0) + frequency * count`
    from a token's logit, counting the generated tokens only; repetition_penalty (> 1
    discourages) divides a positive logit and multiplies a negative one of every token seen in
    the prompt or the output; min_p drops tokens less likely than min_p times the most likely
    one (sampling only); min_tokens masks EOS and stop_token_ids (and ignores stop strings)
    until that many tokens were generated; logit_bias adds a bias to a token id's logit.
    Each has a value that switches it off: 0, 0, 1, 0, 0, ().

    logprobs k (None: off) returns each generated token's log-probability and the k most likely
    tokens' at its position; prompt_logprobs k the same for every prompt token but the first.
    Both are of the model's raw distribution (services/common/logprobs.py), k in [0, 20].

    n: the number of answers (choices) returned. best_of (None: n): the number generated, of
    which the n with the highest cumulative logprob of their tokens are returned. The prompt
    is prefilled once; choice i samples from its own stream (the seed, or the request's own,
    plus i), so choices differ unless greedy and a seeded request is reproducible.

    structured_output: what the answer must match (a JSON schema, any JSON object, a regex, a
    choice or a grammar; services/common/structured_output.py): only tokens its grammar allows
    are sampled, and the request ends with finish reason stop once the answer is complete.
    None: free text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    # (token id, bias) pairs in id order; a dict {id: bias} is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_choices(self) -> int:
        """How many answers are generated (best_of, else n); each is a sequence of its own
        once the prompt is prefilled."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on: the sampler then needs the request's token counts."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processed(self) -> bool:
        """Whether any logits processor is on (else the sampler's fast path serves it)."""
        return self.penalized or bool(self.logit_bias) or self.min_p > 0.0 or self.min_tokens > 0

    def validate(self) -> None:
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidRequest(f"{flag} must be true or false", param=flag)
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
        self._validate_processors()
        self._validate_choices()
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise InvalidRequest(
                "structured_output must be a StructuredOutput", param="structured_output"
            )

    def _validate_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequest(
                    f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), "
                    f"got {value!r}",
                    param=name,
                )
        rp = self.repetition_penalty
        if not _is_finite(rp) or not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 is off, > 1 discourages repeats), got {rp!r}",
                param="repetition_penalty",
            )
        if not _is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(
                f"min_p must be a number in [0, 1] (0 is off), got {self.min_p!r}", param="min_p"
            )
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise InvalidRequest(
                f"min_tokens must be an integer, got {self.min_tokens!r}", param="min_tokens"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens] (max_tokens is {self.max_tokens}), "
                f"got {self.min_tokens}",
                param="min_tokens",
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(
                f"logit_bias holds {len(self.logit_bias)} entries; at most "
                f"{MAX_LOGIT_BIAS_ENTRIES}",
                param="logit_bias",
            )
        for token, bias in self.logit_bias:
            if not _is_finite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequest(
                    f"logit_bias of token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {bias!r}",
                    param="logit_bias",
                )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (
                isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS
            ):
                raise InvalidRequest(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] (the most likely tokens "
                    f"returned beside the chosen one), got {k!r}",
                    param=name,
                )

    def _validate_choices(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest(
                f"n must be an integer in [1, {MAX_N}] (the answers returned), got {self.n!r}",
                param="n",
            )
        b = self.best_of
        if b is not None and (
            isinstance(b, bool) or not isinstance(b, int) or not self.n <= b <= MAX_N
        ):
            raise InvalidRequest(
                f"best_of must be an integer in [n, {MAX_N}] (n is {self.n}: the answers "
                f"generated, of which the n most likely are returned), got {b!r}",
                param="best_of",
            )

    def check_vocabulary(self, vocab_size: int) -> None:
        """InvalidRequest naming the first token id (of stop_token_ids or logit_bias) that the
        model's vocabulary [0, vocab_size) lacks."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequest(
                    f"stop token id {t} is outside the vocabulary [0, {vocab_size})",
                    param="stop_token_ids",
                )
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise InvalidRequest(
                    f"logit_bias names token id {t}, outside the vocabulary [0, {vocab_size})",
                    param="logit_bias",
                )


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    return _is_number(x) and math.isfinite(x)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (id, bias) pairs in id order, from a dict or pairs (e.g. decoded JSON)."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [tuple(item) for item in items]
    except TypeError:
        raise InvalidRequest(
            f"logit_bias must map token ids to biases, got {value!r:.40}", param="logit_bias"
        ) from None
    if any(len(p) != 2 for p in pairs):
        raise InvalidRequest("logit_bias must map token ids to biases", param="logit_bias")
    for token, _ in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest(
                f"logit_bias keys must be token ids (integers >= 0), got {token!r:.40}",
                param="logit_bias",
            )
    pairs.sort(key=lambda p: p[0])
    if any(a[0] == b[0] for a, b in itertools.pairwise(pairs)):
        raise InvalidRequest("logit_bias names a token id twice", param="logit_bias")
    return tuple(pairs)
