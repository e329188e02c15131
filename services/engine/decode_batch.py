"""The running set of a continuous-batching decode: sequences join and leave between steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.errors import OutOfKvBlocks
from services.engine.block_pool import BlockPool
from services.engine.sequence import Sequence

if TYPE_CHECKING:
    from services.engine.sampler import TokenCounts


class DecodeBatch:
    """Sequences that hold KV and get one token per step, in the order they joined.

    `counts` (the real runner's; None for the emulated one, which has no logits) keeps the
    token counts the penalties read: a penalized sequence gets its row when it joins and gives
    it back when it leaves or is preempted, so a step never rebuilds them from token lists.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        counts: TokenCounts | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.counts = counts
        self.seqs: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def free_seats(self) -> int:
        return self.max_num_seqs - len(self.seqs)

    def join(self, seq: Sequence) -> None:
        self.seqs.append(seq)
        if self.counts is not None and seq.params.penalized:
            self.counts.add(seq)

    def leave(self, seq: Sequence) -> None:
        self.seqs.remove(seq)
        if self.counts is not None:
            self.counts.remove(seq)

    def reserve_next_slots(self) -> list[Sequence]:
        """Give every sequence a cache slot for the token it decodes next.

        When the pool runs dry, the most recently joined sequences are preempted (their blocks
        freed) until the rest fit; they are returned so the caller can queue them for recompute.
        """
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.seqs):
            seq = self.seqs[i]
            need = seq.blocks_needed(seq.num_tokens, self.block_size)
            if need == 0:
                i += 1
                continue
            try:
                seq.block_table.extend(self.pool.allocate(need, after=seq.block_table.last))
                i += 1
            except OutOfKvBlocks:
                victim = self.seqs.pop()
                if self.counts is not None:
                    self.counts.remove(victim)
                self.pool.free(victim.block_table.blocks)
                victim.block_table = type(victim.block_table)()
                preempted.append(victim)
        return preempted
