"""The paged KV cache's allocator: fixed-size blocks, reference counts, contiguous placement,
and the prefix cache's blocks.

A sequence's KV lives in blocks of `block_size` tokens. The pool places each sequence in one
contiguous run of blocks when it can, because a contiguous run of blocks is one contiguous byte
range per layer: the decode step reads it without gathering, and the KV-transfer service moves it
as one region. New sequences go at the end of the largest free run, leaving their expected
growth free behind them; a growing sequence first takes the block right after its last one.

Prefix cache: a full block whose KV is written may be `register`ed under its chained hash
(services/common/prefix_hash.py). When its last reference goes, a cached block is not emptied: it
stays cached, with no owner, in a queue in least-recently-freed order, and a new sequence with
the same prefix takes it back (`cached_prefix`, `acquire`). Such blocks count as free: an
allocation that finds too few empty blocks evicts them, least recently used first. A sequence
frees its blocks last to first, so its later blocks are evicted before the prefix they extend.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.errors import OutOfKvBlocks
from services.engine.kv_events import KvEventLog


@dataclass
class BlockTable:
    """The blocks of one sequence in order, and the same list as runs of consecutive ids."""

    blocks: list[int] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)  # [first block, number of blocks]

    def extend(self, new: list[int]) -> None:
        for b in new:
            if self.runs and self.runs[-1][0] + self.runs[-1][1] == b:
                self.runs[-1][1] += 1
            else:
                self.runs.append([b, 1])
        self.blocks.extend(new)

    @property
    def last(self) -> int | None:
        return self.blocks[-1] if self.blocks else None

    def __len__(self) -> int:
        return len(self.blocks)


class BlockPool:
    """Hands out KV blocks: `can_allocate / allocate / free`, with reference counts, and keeps
    the cached blocks of the prefix cache (see the module docstring)."""

    def __init__(self, num_blocks: int, events: KvEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # Empty space as sorted, disjoint, non-adjacent runs: starts[i] .. starts[i] + lens[i].
        self._starts: list[int] = [0]
        self._lens: list[int] = [num_blocks]
        self._empty = num_blocks
        # The prefix cache: hash <-> block, and the cached blocks nobody references (evictable),
        # least recently freed first.
        self._block_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.events = events or KvEventLog()
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: empty ones and cached ones nobody references."""
        return self._empty + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def can_allocate(self, n: int, reusing: Iterable[int] = ()) -> bool:
        """Whether `n` new blocks fit, after taking the cached blocks `reusing` (`acquire`)."""
        return n + sum(1 for b in reusing if self._refs[b] == 0) <= self.num_free

    def allocate(self, n: int, *, after: int | None = None, reserve: int = 0) -> list[int]:
        """Take `n` blocks, as few runs as possible.

        after: the caller's last block; the blocks right after it are taken if free.
        reserve: how many more blocks the caller expects to need; placement leaves that many free
        after the new run when some free run is long enough.
        """
        if n <= 0:
            return []
        if n > self.num_free:
            raise OutOfKvBlocks(n, self.num_free)
        if n > self._empty:
            self._evict(n - self._empty)
        if after is not None:
            taken = self._take_after(after, n)
            if taken:
                return taken
        out: list[int] = []
        while len(out) < n:
            # Carve from the largest free run: small runs are mostly the growth room that
            # earlier sequences left behind themselves.
            i = max(range(len(self._lens)), key=self._lens.__getitem__)
            start, length = self._starts[i], self._lens[i]
            take = min(n - len(out), length)
            offset = length - take - (reserve if length >= take + reserve else 0)
            out.extend(self._take(i, start + offset, take))
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block of a sequence (given in order); blocks with no
        reference left become free: empty, or evictable if cached (the last ones first)."""
        for b in reversed(blocks):
            refs = self._refs[b]
            if refs <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._refs[b] = refs - 1
            if refs == 1:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._release(b)

    def incref(self, blocks: list[int]) -> None:
        """Share blocks with another owner (prefix sharing); each owner frees them once."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # -- the prefix cache ------------------------------------------------------------------------

    def cached_prefix(self, hashes: Iterable[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a prompt's block hashes, in
        order) that is all cached. Takes no reference: see `acquire`."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (from `cached_prefix`), for a new owner."""
        for b in blocks:
            if b not in self._hash_of:
                raise ValueError(f"block {b} is not cached")
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def register(self, block: int, block_hash: int) -> bool:
        """Cache a referenced block whose KV is fully written under its hash. False (and
        nothing changes) if the hash is cached already, in another block, or the block is."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self.events.stored(block_hash)
        return True

    def cached_hashes(self) -> list[int]:
        """Every cached hash, the most recently cached first."""
        return list(reversed(self._block_of))

    def _evict(self, n: int) -> None:
        """Empty the `n` least recently freed cached blocks."""
        for _ in range(n):
            b, _ = self._evictable.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._block_of[h]
            self.events.removed(h)
            self.num_evicted += 1
            self._release(b)

    # -- free-run bookkeeping ------------------------------------------------------------------

    def _take_after(self, block: int, n: int) -> list[int]:
        i = bisect.bisect_left(self._starts, block + 1)
        if i < len(self._starts) and self._starts[i] == block + 1 and self._lens[i] >= n:
            return self._take(i, block + 1, n)
        return []

    def _take(self, i: int, start: int, n: int) -> list[int]:
        """Cut [start, start + n) out of free run i."""
        run_start, run_len = self._starts[i], self._lens[i]
        head, tail = start - run_start, run_start + run_len - (start + n)
        assert head >= 0 and tail >= 0, "allocation outside its free run"
        pieces = [(s, ln) for s, ln in ((run_start, head), (start + n, tail)) if ln > 0]
        self._starts[i : i + 1] = [s for s, _ in pieces]
        self._lens[i : i + 1] = [ln for _, ln in pieces]
        for b in range(start, start + n):
            self._refs[b] = 1
        self._empty -= n
        return list(range(start, start + n))

    def _release(self, b: int) -> None:
        i = bisect.bisect_left(self._starts, b)
        joins_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == b
        joins_next = i < len(self._starts) and self._starts[i] == b + 1
        if joins_prev and joins_next:
            self._lens[i - 1] += 1 + self._lens[i]
            del self._starts[i], self._lens[i]
        elif joins_prev:
            self._lens[i - 1] += 1
        elif joins_next:
            self._starts[i] = b
            self._lens[i] += 1
        else:
            self._starts.insert(i, b)
            self._lens.insert(i, 1)
        self._empty += 1

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every run of empty blocks (cached ones are not), for tests and
        stats."""
        return list(zip(self._starts, self._lens, strict=True))
