"""The typed events of a request's stream inside the gateway.

A prefill call's events (`HandleReady`, then `Prefilled`) are read by the handoff; every serving
path yields `Tokens` and, last, `Done` to the router, which yields the same two types, with the
text they complete, to the gRPC and HTTP edges. An error ends a stream as an exception (gRPC's
`AioRpcError` from a worker, a `DistServeError` from the gateway), so that leaving a stream early
and failing in it free what they hold the same way (`async with`, `aclosing`).

A request of several choices (n > 1, best_of) has one stream: each `Tokens` and `Done` names its
choice (`index`), each choice ends with its own `Done`, and the stream ends after the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.gen.distserve.v1 import common_pb2
from services.common.logprobs import TokenLogprobs
from services.common.sampling import FinishReason


@dataclass(frozen=True)
class HandleReady:
    """A prefill instance scheduled the prompt and sent the handle on its KV before computing
    it (layer-wise handoff): a decode instance can pull each layer as it is written."""

    kv: common_pb2.KvHandle


@dataclass(frozen=True)
class Prefilled:
    """A prefill instance's result: the first token and the KV it holds for decode (None: none
    held, the request ended at its first token or its KV was given up while computed), and the
    logprobs the request asked for (the first token's; the prompt's, positions 1..)."""

    first_token: int
    finish_reason: FinishReason | None
    kv: common_pb2.KvHandle | None
    compute_ms: float
    batch_tokens: int
    first_logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # A request of several choices: the first token of each of choices 1.. (the fields above
    # are choice 0's), as events.
    other_choices: tuple[Output, ...] = ()

    def firsts(self) -> list[Output]:
        """Every choice's first token as an event (`Done` for a choice it ended)."""
        first = output(
            [self.first_token], self.finish_reason, self.first_logprobs, self.prompt_logprobs
        )
        return [first, *self.other_choices]


@dataclass(frozen=True)
class Tokens:
    """New tokens of the answer (none: a worker's reply that carried no token, e.g. decode's
    first after its pull), and, from the router on, the text they completed. `logprobs`: one
    per token when the request asked for them; `prompt_logprobs`: on the answer's first event,
    when asked."""

    token_ids: list[int]
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    index: int = 0  # the choice (n > 1, best_of)


@dataclass(frozen=True)
class Done:
    """The answer's last tokens (maybe none) and why it ended (logprobs: as in `Tokens`)."""

    token_ids: list[int]
    reason: FinishReason
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    index: int = 0  # the choice (n > 1, best_of)


Output = Tokens | Done  # what a serving path and the router yield


def output(
    token_ids: list[int],
    reason: FinishReason | None,
    logprobs: tuple[TokenLogprobs, ...] = (),
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None,
    index: int = 0,
) -> Output:
    """A worker's reply as an event: `Done` if it ended the answer (its choice `index`)."""
    if reason is None:
        return Tokens(token_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=index)
    return Done(token_ids, reason, logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=index)
