"""The prefix cache's change log: which block hashes an engine cached and dropped since it was
last asked, bounded, for a worker to tell the gateway where prefixes are cached.

The log keeps the net change per hash (stored or removed), not every event: a receiver that
applies `stored` and `removed` to the view it had at the previous drain holds the engine's
cached set (a hash stored and removed in between may be reported removed though the receiver
never had it, which is harmless). When more hashes changed than the log holds, it gives up
on the changes and the next drain is a `reset`: the current cached set, which replaces the
receiver's view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class KvEvents:
    """What changed in an engine's prefix cache since the previous drain.

    stored: hashes newly cached. removed: hashes evicted or dropped. reset: the log overflowed;
    `stored` is then the whole current cached set (at most the drain's `max_events`, the most
    recently cached first) and replaces the receiver's view, and `removed` is empty."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False


class KvEventLog:
    """The net change per block hash since the last `drain`, at most `capacity` hashes."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity <= 0:
            raise ValueError("a KV event log needs a positive capacity")
        self.capacity = capacity
        self._changes: dict[int, bool] = {}  # hash -> cached now (True) or dropped (False)
        self._overflowed = False

    def stored(self, block_hash: int) -> None:
        self._note(block_hash, True)

    def removed(self, block_hash: int) -> None:
        self._note(block_hash, False)

    def _note(self, block_hash: int, cached: bool) -> None:
        if self._overflowed:
            return
        self._changes[block_hash] = cached
        if len(self._changes) > self.capacity:
            self._overflowed = True
            self._changes.clear()

    def drain(self, max_events: int, cached: Callable[[], list[int]]) -> KvEvents:
        """The changes since the last drain, and a fresh log. More than `max_events` changes (or
        an overflow) give a reset: `cached()` (the current set, most recent first) capped at
        `max_events`."""
        changes, overflowed = self._changes, self._overflowed
        self._changes, self._overflowed = {}, False
        if overflowed or len(changes) > max_events:
            return KvEvents(stored=cached()[:max_events], reset=True)
        return KvEvents(
            stored=[h for h, now in changes.items() if now],
            removed=[h for h, now in changes.items() if not now],
        )
