"""Which cached prompt prefixes each worker holds, as the gateway knows them: KV-aware routing.

A worker with a prefix cache names each full KV block it holds by a hash chained over the
prompt's tokens (services/common/prefix_hash.py) and reports what it stored and evicted on its
load feed (`PrefixCacheEvents` in each `LoadReport`), so the events arrive in order with the load
they go with, and a gateway that subscribes (it started, or the feed broke) gets the whole set
first. Events are at most a report old (0.5 s); the gateway does not wait for them: the moment
it routes a prompt to a worker it counts the prompt's blocks as held there (`predict`), for a
few seconds, until the worker's own report confirms or drops them. So the second turn of a
conversation finds its first turn's prefix even when it comes back within the report interval.

A prompt's hashes depend on the worker's salt (its model, dtype and weights) and block size:
`PromptBlocks` computes them once per (salt, block size) for one request, so a mesh of one model
hashes each prompt once, and a worker serving other weights never matches.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.common.prefix_hash import block_hashes

PREDICTED_S = 5.0  # how long a routed prompt's blocks count as held without the worker's word


@dataclass
class CachedBlocks:
    """One worker's prefix cache as reported: its salt, block size and block hashes held."""

    salt: bytes = b""  # empty: the worker has no prefix cache
    block_size: int = 16
    held: set[int] = field(default_factory=set)
    # Blocks of prompts routed to the worker, not yet in a report: hash -> until (monotonic s).
    predicted: dict[int, float] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.salt)

    def apply(self, reset: bool, stored: Iterable[int], removed: Iterable[int]) -> None:
        """A worker's report: with `reset`, `stored` is all it holds."""
        stored = list(stored)
        if reset:
            self.held = set(stored)
        else:
            self.held.update(stored)
        for h in removed:
            self.held.discard(h)
            self.predicted.pop(h, None)
        for h in stored:  # confirmed: no longer only predicted
            self.predicted.pop(h, None)
        self._expire()

    def predict(self, hashes: Sequence[int], now: float | None = None) -> None:
        """A prompt with these block hashes was routed here: count them as held for a while."""
        until = (time.monotonic() if now is None else now) + PREDICTED_S
        for h in hashes:
            if h not in self.held:
                self.predicted[h] = until

    def prefix_blocks(self, hashes: Sequence[int], now: float | None = None) -> int:
        """How many of the leading `hashes` are held here (or predicted to be)."""
        now = time.monotonic() if now is None else now
        n = 0
        for h in hashes:
            if h in self.held or self.predicted.get(h, 0.0) > now:
                n += 1
            else:
                break
        return n

    def _expire(self) -> None:
        if len(self.predicted) > 4 * len(self.held) + 1024:
            now = time.monotonic()
            self.predicted = {h: t for h, t in self.predicted.items() if t > now}


class PromptBlocks:
    """One prompt's block hashes, computed once for each (salt, block size) asked."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[tuple[bytes, int], list[int]] = {}

    def hashes(self, cache: CachedBlocks) -> list[int]:
        if not cache.enabled:
            return []
        key = (cache.salt, cache.block_size)
        out = self._hashes.get(key)
        if out is None:
            out = self._hashes[key] = block_hashes(self.token_ids, cache.block_size, cache.salt)
        return out

    def cached_tokens(self, cache: CachedBlocks) -> int:
        """Prompt tokens whose KV `cache` holds, at most all but the last prompt token (a
        worker always computes one, to have logits to sample the first token from)."""
        hashes = self.hashes(cache)
        if not hashes:
            return 0
        held = cache.prefix_blocks(hashes) * cache.block_size
        return min(held, len(self.token_ids) - 1)
