"""A worker's prefix cache as its load feed reports it to every gateway (KV events).

The engine thread records what its prefix cache stored and evicted after each step (`record`);
the load feed takes what changed since its last report (`report`) and sends it to every gateway
subscribed. A gateway that subscribes gets everything held first (`whole`), then the changes:
applying a change twice is harmless (stored adds, removed discards), so a change that a whole set
already showed may come again. A log that overflowed makes the next report whole: every hash
held, `reset` set, and gateways replace their view. So a gateway's view is at most one report
behind and never drifts, and one report is bounded by `max_events` changes (or by the cache's
size when whole).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from services.common.gen.distserve.v1 import common_pb2


class PrefixCacheLog:
    """What a worker's prefix cache holds and what changed since the last report."""

    def __init__(self, salt: bytes, max_events: int = 4096) -> None:
        self.salt = salt
        self.max_events = max_events
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._stored: set[int] = set()
        self._removed: set[int] = set()
        self._whole = True  # the first report is the whole set

    def record(self, reset: bool, stored: Iterable[int], removed: Iterable[int]) -> None:
        """On the engine thread: what the cache stored and evicted (with `reset`, `stored` is
        all it holds)."""
        with self._lock:
            if reset:
                self._held = set(stored)
                self._whole = True
            else:
                for h in stored:
                    self._held.add(h)
                    self._stored.add(h)
                    self._removed.discard(h)
                for h in removed:
                    self._held.discard(h)
                    self._removed.add(h)
                    self._stored.discard(h)
            if len(self._stored) + len(self._removed) > self.max_events:
                self._whole = True
            if self._whole:
                self._stored.clear()
                self._removed.clear()

    def report(self, whole: bool = False) -> common_pb2.PrefixCacheEvents:
        """What changed since the last report (all that is held, when `whole` or when the
        changes were not kept); the changes are then taken."""
        with self._lock:
            if whole or self._whole:
                out = common_pb2.PrefixCacheEvents(reset=True, stored=self._held)
            else:
                out = common_pb2.PrefixCacheEvents(stored=self._stored, removed=self._removed)
            self._whole = False
            self._stored = set()
            self._removed = set()
        return out

    def whole(self) -> common_pb2.PrefixCacheEvents:
        """Everything held now (for a new subscriber); the changes are kept for the others."""
        with self._lock:
            return common_pb2.PrefixCacheEvents(reset=True, stored=self._held)

    def __len__(self) -> int:
        return len(self._held)


def prefix_cache_stats(engine, pulled_tokens_reused: int = 0) -> dict[str, int]:
    """The WorkerStats fields of an engine's prefix cache (`LLMEngine.prefix_stats`);
    `pulled_tokens_reused`: a decode instance's prompt tokens it did not pull, having them."""
    s = engine.prefix_stats
    return {
        "prompt_tokens_computed": s.prompt_tokens_computed,
        "prompt_tokens_cached": s.prompt_tokens_reused + pulled_tokens_reused,
        "kv_blocks_evicted": s.blocks_evicted,
        "prefix_cache_blocks": s.blocks_cached,
    }
