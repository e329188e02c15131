"""Packing of waiting prompts into prefill batches under a token budget (L_m)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services.engine.sequence import Sequence


class PrefillBatcher:
    """First come, first served: take waiting prompts in order while their tokens fit the budget.

    `max_batch_tokens` is L_m, the batch size in tokens past which prefill stops gaining
    throughput; a prompt longer than L_m runs alone. `admit` says whether a sequence's KV fits now
    (and reserves it); the first sequence that does not fit ends the batch, so order is kept.
    `cost` is the tokens a sequence's prefill computes (default: all of them; with a prefix
    cache, those after its cached prefix). `max_seqs` counts seats: a prompt of n choices takes
    n (`Sequence.width`), as each becomes a sequence of the decode batch.
    """

    def __init__(self, max_batch_tokens: int, max_batch_seqs: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs

    def next_batch(
        self,
        waiting: deque[Sequence],
        admit: Callable[[Sequence], bool],
        max_seqs: int,
        cost: Callable[[Sequence], int] | None = None,
    ) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = seats = 0
        limit = min(self.max_batch_seqs, max_seqs)
        while waiting:
            seq = waiting[0]
            if seats + seq.width > limit:
                break
            n = seq.num_tokens if cost is None else cost(seq)
            if batch and tokens + n > self.max_batch_tokens:
                break
            if not admit(seq):
                break
            waiting.popleft()
            batch.append(seq)
            tokens += n
            seats += seq.width
        return batch
