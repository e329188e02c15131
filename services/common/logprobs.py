"""Log-probabilities of tokens, as the engine computes them and every layer above carries them.

They are the model's raw distribution at a position: log_softmax of its logits before
temperature, penalties, logit_bias, min_p, top-k/top-p and min_tokens (vLLM's default
`logprobs_mode`, raw_logprobs), so they describe the model, not the sampler's choice among its
tokens. A request asks for them with SamplingParams.logprobs (each generated token's, with the k
most likely alternatives) and SamplingParams.prompt_logprobs (each prompt token's but the first,
which nothing predicts).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (vLLM's default)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there (sampled, or the prompt's), its log-probability and rank
    (1 = the most likely token), and the k most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
