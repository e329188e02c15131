"""What the load generator sends: prompts of exact token counts at chosen arrival times."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.errors import InvalidRequest
from services.planner.workload import Requests

# Ids below this are the presets' special tokens (begin/end of text, chat markers); random
# prompts avoid them so that no prompt carries an end-of-text in its middle.
FIRST_ORDINARY_ID = 4


@dataclass(frozen=True)
class LoadRequest:
    """One request: when to send it (s from the start of the run), its prompt as token ids, and
    how many tokens to ask for (sent as `max_tokens` with `ignore_eos`, so it is the exact output
    length of a request that succeeds)."""

    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or self.max_tokens < 1 or not self.prompt_ids:
            raise InvalidRequest("a load request needs arrival_s >= 0, max_tokens >= 1, a prompt")


def load_requests(
    requests: Requests,
    vocab_size: int,
    seed: int | tuple[int, ...] = 0,
    first_id: int = FIRST_ORDINARY_ID,
) -> list[LoadRequest]:
    """A workload's requests as prompts of exactly `requests.prompt[i]` random token ids from
    [first_id, vocab_size), seeded, so that the same (requests, seed) always gives the same
    prompts; `max_tokens` is the output length.

    Runs on one mesh that should not share prompts take seeds of their own (a tuple, e.g.
    (seed, probe)): a prompt sent twice finds its KV in the workers' prefix caches the second
    time, and a run meant to measure serving without reuse would measure the cache."""
    if vocab_size <= first_id:
        raise InvalidRequest(f"vocab_size {vocab_size} leaves no ordinary token ids")
    rng = np.random.default_rng(seed)
    out = []
    for t, n, m in zip(requests.arrival_s, requests.prompt, requests.output, strict=True):
        ids = rng.integers(first_id, vocab_size, int(n))
        out.append(LoadRequest(float(t), tuple(ids.tolist()), int(m)))
    return out


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """`n` arrival times (s, from 0) of a Poisson process of `rate` per second: the cumulative
    sum of exponential gaps drawn from `rng`."""
    return np.cumsum(rng.exponential(1 / rate, n))
