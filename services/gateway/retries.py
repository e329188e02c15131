"""How often one request is tried again, whatever failed: one budget per request.

A request can fail over in three ways, each invisible to the client: its prefill instance is
unreachable before anything was streamed (`PREFILL_UNAVAILABLE`: prefill elsewhere), its KV
cannot be pulled by a decode instance (`KV_HANDOFF`: prefill again, decode continues from the
first token the client has), or the instance streaming its tokens is lost (`DECODE_UNAVAILABLE`:
the prompt and the tokens sent so far are prefilled again and decoding goes on). They nest (a
migrated request goes through a new handoff, which may find a prefill instance down), so
separate limits per loop multiply: three loops of three once allowed 27 prefills for one
request. Here every retry of a request, of any kind, is drawn from one `Retries`: at most
`RetryPolicy.budget` in all and `per_kind` of one kind.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


class Failover(enum.Enum):
    """Why a request is tried again (the values are the `distserve_migrations_total` reasons)."""

    PREFILL_UNAVAILABLE = "prefill_unavailable"
    KV_HANDOFF = "kv_handoff"
    DECODE_UNAVAILABLE = "decode_unavailable"


@dataclass(frozen=True)
class RetryPolicy:
    """`budget`: retries of one request in all; `per_kind`: of one `Failover` kind at most."""

    budget: int = 4
    per_kind: int = 2

    def __post_init__(self) -> None:
        if self.budget < 0 or self.per_kind < 0:
            raise ValueError(f"retry limits must be >= 0, got {self.budget}, {self.per_kind}")

    def start(self, on_retry: Callable[[Failover], None] | None = None) -> Retries:
        """A new request's retries; `on_retry(kind)` is called for each one granted."""
        return Retries(self, on_retry)


class Retries:
    """One request's retries so far, and the failures that asked for them."""

    def __init__(self, policy: RetryPolicy, on_retry: Callable[[Failover], None] | None) -> None:
        self.policy = policy
        self._on_retry = on_retry
        self._used: Counter[Failover] = Counter()
        self.failures: list[str] = []  # each failure, in order, for the final error

    @property
    def used(self) -> int:
        return sum(self._used.values())

    def count(self, kind: Failover) -> int:
        return self._used[kind]

    def allow(self, kind: Failover, failure: str) -> bool:
        """A try failed with `failure`: True if the request may be tried again (the retry is
        counted), False if its budget or its kind's limit is spent."""
        self.failures.append(failure)
        if self.used >= self.policy.budget or self._used[kind] >= self.policy.per_kind:
            return False
        self._used[kind] += 1
        if self._on_retry is not None:
            self._on_retry(kind)
        return True
