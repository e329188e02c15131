"""Validation of a request into a domain object: everything checked before routing, in one
path for the gRPC and the HTTP API."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.convert import sampling_from_pb
from services.common.errors import DeadlineExceeded, InvalidRequest
from services.common.generation_defaults import GenerationDefaults
from services.common.model_config import ModelConfig
from services.common.sampling import MAX_N, SamplingParams
from services.common.tokenizer import Tokenizer

if TYPE_CHECKING:
    from services.gateway.chat_request import ChatCall

MAX_REQUEST_ID_CHARS = 128
MAX_PROMPT_CHARS = 4 * 2**20
# Texts longer than this are tokenized on a worker thread (a thread hop costs more than
# tokenizing a short prompt).
THREAD_TOKENIZE_CHARS = 16 * 2**10


@dataclass(frozen=True)
class Request:
    """A validated request: token ids, parameters and a deadline (monotonic seconds or None)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None
    # Names this request in the workers: unique even when clients reuse a request id (the
    # workers' state of an earlier request with that id may still be settling).
    call_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def worker_request_id(self) -> str:
        return f"{self.request_id}~{self.call_id}"

    def attempt(self) -> Request:
        """The same request as a new call: each attempt at a stage has its own id in the
        workers, where an earlier attempt's state (e.g. KV held for it) may still be settling."""
        return dataclasses.replace(self, call_id=uuid.uuid4().hex[:12])

    def continued(self, sent: Sequence[int]) -> Request:
        """The rest of this request once `sent` tokens reached the client: those tokens join
        the prompt, fewer are left to generate, and the workers see a new call. (A seeded
        sampler does not replay its random stream: only greedy output is the same as without
        the move; nor do presence and frequency penalties, which count generated tokens only,
        see the moved tokens, now part of the prompt.) Once a token was sent, so were the
        prompt's logprobs (with the first): the rest does not ask for them again. A
        structured-output constraint replays the moved tokens: the new instance's matcher reads
        them first, so the answer goes on from the same grammar state."""
        structured = self.params.structured_output
        params = dataclasses.replace(
            self.params,
            max_tokens=self.params.max_tokens - len(sent),
            min_tokens=max(0, self.params.min_tokens - len(sent)),
            prompt_logprobs=None if sent else self.params.prompt_logprobs,
            structured_output=structured.replayed(len(sent)) if structured else None,
        )
        return dataclasses.replace(
            self.attempt(), prompt_ids=[*self.prompt_ids, *sent], params=params
        )

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def timeout(self) -> float | None:
        """The time left for a downstream call (None: no deadline); DeadlineExceeded if none."""
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"request {self.request_id} ran out of time")
        return remaining


@dataclass(frozen=True)
class Limits:
    """What this gateway accepts. The context is the model's max_position_embeddings, or less
    where the workers serve less (`served`: their smallest max_model_len, None when unknown)."""

    model_context: int
    vocab_size: int
    max_tokens: int  # largest max_tokens a request may ask for
    served: Callable[[], int | None] = lambda: None
    # At most this many tokens for a request that names no max_tokens (generation_config.json's
    # max_new_tokens, as vLLM); None: the context's room.
    default_max_tokens: int | None = None
    max_n: int = MAX_N  # most choices (n, best_of) a request may ask for (--max-n)

    @classmethod
    def for_model(
        cls,
        model: ModelConfig,
        max_tokens: int | None = None,
        served: Callable[[], int | None] = lambda: None,
        default_max_tokens: int | None = None,
        max_n: int = MAX_N,
    ) -> Limits:
        return cls(
            model_context=model.max_position_embeddings,
            vocab_size=model.vocab_size,
            max_tokens=max_tokens or model.max_position_embeddings,
            served=served,
            default_max_tokens=default_max_tokens,
            max_n=max_n,
        )

    @property
    def max_context(self) -> int:
        """The longest prompt + output a request may have now (max_model_len)."""
        served = self.served()
        return min(served, self.model_context) if served else self.model_context


async def validate(
    pb,
    tokenizer: Tokenizer,
    limits: Limits,
    grpc_remaining: float | None,
    default_request_id: str = "",
    defaults: GenerationDefaults | None = None,
    chat: ChatCall | None = None,
) -> Request:
    """Check a gRPC GenerateRequest; InvalidRequest with an actionable message if anything is
    off. The checks themselves are `build_request`'s, shared with the HTTP API.
    `default_request_id` (e.g. Envoy's x-request-id) is used when the request names none;
    `defaults` (generation_config.json) fill the sampling fields it leaves unset. `chat` is the
    request's `chat` checked and rendered (chat_request.chat_call, as the HTTP API's)."""
    kind = pb.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("give a prompt: `text`, `token_ids` or `chat`", param="prompt")
    params = sampling_from_pb(pb.sampling, defaults)
    if kind == "chat":
        if chat is None:
            raise InvalidRequest("this gateway renders no `chat`: send text or token_ids", "chat")
        prompt: str | list[int] = chat.prompt.text
        params = chat.applied(params)
    else:
        prompt = pb.text if kind == "text" else list(pb.token_ids.ids)
    budgets = (grpc_remaining, pb.timeout_ms / 1000 if pb.timeout_ms else None)
    return await build_request(
        prompt,
        params,
        tokenizer,
        limits,
        request_id=pb.request_id or default_request_id,
        budgets=budgets,
        fill_context=not pb.sampling.max_tokens and limits.default_max_tokens is not None,
        add_special_tokens=kind != "chat",  # a rendered chat carries its own special tokens
    )


async def build_request(
    prompt: str | Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer,
    limits: Limits,
    *,
    request_id: str = "",
    budgets: Sequence[float | None] = (),
    fill_context: bool = False,
    add_special_tokens: bool = True,
) -> Request:
    """The one validation path of every API (gRPC and HTTP): tokenize the prompt and check it
    and the parameters against the model and this server's limits.

    `prompt` is text or token ids. `budgets` are time limits in seconds (the earliest wins; None
    or 0 is no limit). `fill_context`: the caller did not choose max_tokens, so generate up to
    the context (capped by the server's limit and the model's default) instead of
    `params.max_tokens`.
    `add_special_tokens`: add what the tokenizer adds to text (e.g. BOS); a chat template that
    renders its own special tokens turns it off. A long text is tokenized on a worker thread,
    so the event loop keeps serving everyone else meanwhile.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt is empty: give at least one character", param="prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest(
                f"prompt text is longer than {MAX_PROMPT_CHARS} characters", param="prompt"
            )
        limit = limits.max_context - 1
        if len(prompt) > THREAD_TOKENIZE_CHARS:
            n, ids = await asyncio.to_thread(
                tokenizer.encode_within, prompt, limit, add_special_tokens
            )
        else:
            n, ids = tokenizer.encode_within(prompt, limit, add_special_tokens)
        if ids is None:
            raise _too_long(n, limits)
    else:
        ids = list(prompt)
        if not ids:
            raise InvalidRequest("prompt is empty: give at least one token id", param="prompt")
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
                param="prompt",
            )
    max_context = limits.max_context
    if len(ids) >= max_context:
        raise _too_long(len(ids), limits)
    room = max_context - len(ids)
    if fill_context:
        most = min(room, limits.max_tokens, limits.default_max_tokens or room)
        params = dataclasses.replace(params, max_tokens=most)
    if params.max_tokens > limits.max_tokens:
        raise InvalidRequest(
            f"max_tokens is {params.max_tokens}; this server allows at most {limits.max_tokens}",
            param="max_tokens",
        )
    if params.max_tokens > room:
        raise InvalidRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({max_context} tokens); set max_tokens <= {room}",
            param="max_tokens",
        )
    if params.num_choices > limits.max_n:
        field = "best_of" if params.best_of is not None and params.best_of > params.n else "n"
        raise InvalidRequest(
            f"{field} is {params.num_choices}; this server generates at most {limits.max_n} "
            "choices per request (--max-n): ask for fewer, or send several requests",
            param=field,
        )
    params.check_vocabulary(limits.vocab_size)
    request_id = request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest(
            f"request_id must be printable and at most {MAX_REQUEST_ID_CHARS} characters",
            param="request_id",
        )
    limits_s = [b for b in budgets if b]
    deadline = time.monotonic() + min(limits_s) if limits_s else None
    return Request(request_id, ids, params, deadline)


def _too_long(tokens: int, limits: Limits) -> InvalidRequest:
    return InvalidRequest(
        f"prompt has {tokens} tokens; max_model_len is {limits.max_context} tokens of prompt "
        "and output, shorten the prompt",
        param="prompt",
    )
