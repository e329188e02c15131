"""The engine's prefix cache: the cached leading blocks of a sequence, and the caching of the
blocks a step has written.

A full block is identified by its chained hash (services/common/prefix_hash.py, salted with
everything else its KV depends on: the model's weights, the dtype, the block size). Once a step
has written a full block's KV it is registered in the `BlockPool` under that hash; it stays
cached after its request ends, with no owner, until an allocation needs its room (the pool
evicts least recently freed first). A sequence that gets its blocks starts from the longest
cached prefix of its full blocks and computes only the rest. Blocks whose KV is not written yet
(a prefill still to run, a pull in flight) are never registered: within the step that writes
them no other sequence can hit them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.common.prefix_hash import block_hashes
from services.engine.block_pool import BlockPool
from services.engine.kv_events import KvEvents
from services.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's counters since the engine started, and its size now."""

    prompt_tokens_computed: int  # prefilled tokens run through the model (recomputes included)
    prompt_tokens_reused: int  # prefilled tokens whose KV came from the cache (hits)
    blocks_evicted: int
    blocks_cached: int  # now: cached blocks, referenced or evictable


class PrefixCache:
    """Finds a sequence's cached prefix in the pool and caches the blocks it has written.
    `enabled` False: it finds nothing and caches nothing."""

    def __init__(self, pool: BlockPool, block_size: int, salt: bytes, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.salt = salt
        self.enabled = enabled
        self.prompt_tokens_computed = 0
        self.prompt_tokens_reused = 0

    def hits(self, seq: Sequence, num_tokens: int) -> list[int]:
        """The cached blocks of the longest cached prefix of a sequence's first `num_tokens`
        tokens, in full blocks (no reference taken: `BlockPool.acquire`)."""
        if not self.enabled:
            return []
        return self.pool.cached_prefix(self._hashes(seq, num_tokens // self.block_size))

    def uncached_tokens(self, seq: Sequence) -> int:
        """The tokens a waiting sequence's prefill would compute (at least one: the last
        token's logits are sampled from)."""
        return seq.num_tokens - len(self.hits(seq, seq.num_tokens - 1)) * self.block_size

    def commit(self, seq: Sequence, written: int) -> None:
        """A step wrote the KV of a sequence's first `written` tokens: cache its full blocks
        (a block whose hash is cached already, in another block, stays private)."""
        full = written // self.block_size
        if full <= seq.num_committed_blocks or not self.enabled:
            return
        hashes = self._hashes(seq, full)
        blocks = seq.block_table.blocks
        for i in range(seq.num_committed_blocks, full):
            self.pool.register(blocks[i], hashes[i])
        seq.num_committed_blocks = full

    def count(self, seqs: Iterable[Sequence]) -> int:
        """Count a prefill batch's computed and reused tokens; returns the computed ones."""
        computed = reused = 0
        for s in seqs:
            computed += s.num_tokens - s.num_cached_tokens
            reused += s.num_cached_tokens
        self.prompt_tokens_computed += computed
        self.prompt_tokens_reused += reused
        return computed

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            prompt_tokens_computed=self.prompt_tokens_computed,
            prompt_tokens_reused=self.prompt_tokens_reused,
            blocks_evicted=self.pool.num_evicted,
            blocks_cached=self.pool.num_cached,
        )

    def events(self, max_events: int) -> KvEvents:
        """The hashes cached and dropped since the last call (see KvEvents)."""
        return self.pool.events.drain(max_events, self.pool.cached_hashes)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of a sequence's first `num_blocks` full blocks (fewer if it has
        fewer), computed once."""
        if len(seq.block_hashes) < num_blocks:
            seq.block_hashes = block_hashes(
                seq.token_ids, self.block_size, self.salt, limit=num_blocks
            )
        return seq.block_hashes[:num_blocks]
