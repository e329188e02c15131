"""The workers the gateway routes to: membership (followed from the discovery service by
gateway/membership.py) and load (each worker's load feed).

Each worker's load is what its feed reports plus the calls this gateway has sent it since
(`Worker`): exact for this gateway's own work, a snapshot for other gateways'. A member is routed
to while its reports keep coming; one whose feed broke or whose call failed is suspended until
its next report. Which worker a request goes to is decided in gateway/routing.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.gateway.prefix_index import CachedBlocks

log = logging.getLogger("distserve.gateway")


@dataclass
class Load:
    """A worker's last reported load (see common.proto WorkerLoad)."""

    queued_prompt_tokens: int = 0
    running_seqs: int = 0
    waiting_seqs: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    pending_pulls: int = 0
    held_kv_handles: int = 0
    decode_step_ms: float = 0.0
    kv_block_size: int = 16  # tokens per KV block
    max_model_len: int = 0  # the longest prompt + output it serves; 0: not reported

    @property
    def free_kv_tokens(self) -> int:
        """Tokens that fit in the free KV blocks."""
        return self.free_kv_blocks * self.kv_block_size


@dataclass
class _Call:
    """A call the gateway sent a worker: the prompt tokens it has not prefilled yet, and whether
    the worker has answered anything yet."""

    tokens: int
    waiting: bool = True
    kv_tokens: int = 0  # KV it may hold there once it decodes: its prompt and max_tokens


@dataclass
class Worker:
    worker_id: str
    role: str  # prefill | decode | colocated
    address: str
    load: Load = field(default_factory=Load)
    last_seen: float = field(default_factory=time.monotonic)  # its last report (or joining)
    suspended: bool = False  # its feed broke or a call to it failed: not routed until it reports
    cache: CachedBlocks = field(default_factory=CachedBlocks)  # its prefix cache, as reported
    # The calls this gateway has open on the worker, by ticket: exact and current for its own
    # work. A report's load is a snapshot the worker took a moment ago (its engine only sees
    # a call between two steps), so it misses calls just sent and still shows calls that have
    # just ended; what it shows beyond what this gateway had open when it came is other
    # gateways' work. The worker's figures are this gateway's own plus those others'.
    _calls: dict[int, _Call] = field(default_factory=dict, repr=False)
    _tickets: itertools.count = field(default_factory=itertools.count, repr=False)
    # (queued tokens, waiting, open) of this gateway's own calls when the last report came
    _own_at_report: tuple[int, int, int] = (0, 0, 0)

    def send(self, prompt_tokens: int = 0, kv_tokens: int = 0) -> int:
        """A call is going to this worker with a prompt of this many tokens to prefill (0: the
        prompt is prefilled elsewhere), to hold up to `kv_tokens` of KV there once it decodes;
        the ticket follows it (`answered`, `settle`)."""
        ticket = next(self._tickets)
        self._calls[ticket] = _Call(prompt_tokens, kv_tokens=kv_tokens)
        return ticket

    def answered(self, ticket: int) -> None:
        """The worker sent the call's first token: its prompt is prefilled, it waits no more."""
        call = self._calls.get(ticket)
        if call is not None:
            call.tokens, call.waiting = 0, False

    def settle(self, ticket: int) -> None:
        """The call ended (idempotent)."""
        self._calls.pop(ticket, None)

    def _own(self) -> tuple[int, int, int]:
        calls = self._calls.values()
        return sum(c.tokens for c in calls), sum(c.waiting for c in calls), len(self._calls)

    def heard(self, load: Load) -> None:
        """A report's load: remember what of it was this gateway's own work."""
        self.load = load
        self._own_at_report = self._own()

    def _reported(self) -> tuple[int, int, int]:
        load = self.load
        return (
            load.queued_prompt_tokens,
            load.pending_pulls,
            load.running_seqs + load.waiting_seqs + load.pending_pulls,
        )

    def _now(self, i: int) -> int:
        """Figure i (queued tokens, waiting, open) now: this gateway's own, plus what the last
        report showed beyond this gateway's own at the time (other gateways' work)."""
        own = self._own()[i]
        return own + max(0, self._reported()[i] - self._own_at_report[i])

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens queued for prefill there, the batch being computed included."""
        return self._now(0)

    @property
    def waiting_requests(self) -> int:
        """Requests there that have not streamed a token yet (decode: pulling their KV or
        waiting for a seat)."""
        return self._now(1)

    @property
    def open_requests(self) -> int:
        """Requests there: running, waiting or pulling."""
        return self._now(2)

    @property
    def kv_headroom_tokens(self) -> int:
        """KV tokens there that this gateway's requests decoding there cannot grow into: the
        capacity the worker reports, less their prompts and max_tokens. Current at every
        moment, where a report's free blocks are a snapshot of a moment ago: routing on
        the snapshot made two runs of one workload route differently wherever instances tie
        on open requests (other gateways' requests count in `open_requests`)."""
        held = sum(c.kv_tokens for c in self._calls.values() if not c.waiting)
        return self.load.total_kv_blocks * self.load.kv_block_size - held


class Registry:
    """Workers by id, as the discovery service lists them; `live` are those routed to: not
    suspended, and reported within `lease_s` (a worker alive in etcd whose feed went silent, e.g.
    a stopped process, is not routed to)."""

    def __init__(self, lease_s: float = 3.0) -> None:
        self.lease_s = lease_s
        self._workers: dict[str, Worker] = {}

    def register(
        self, worker_id: str, role: str, address: str, load: Load, cache: CachedBlocks | None = None
    ) -> None:
        """A worker joins (or joins again: what was known of it is replaced). One that serves
        a shorter max_model_len than the others is logged: the mesh serves the smallest."""
        served = self.max_model_len()
        if served and load.max_model_len and load.max_model_len != served:
            log.warning(
                "%s serves max_model_len %d, other workers %d: the mesh serves the smaller",
                worker_id,
                load.max_model_len,
                served,
            )
        worker = Worker(worker_id, role, address, load, cache=cache or CachedBlocks())
        worker.cache.block_size = load.kv_block_size
        self._workers[worker_id] = worker

    def report(
        self,
        worker_id: str,
        load: Load,
        events: tuple[bool, Iterable[int], Iterable[int]] | None = None,
        address: str | None = None,
    ) -> bool:
        """A worker's report: its load, and its prefix cache's (reset, stored, removed); with
        `address`, only if it is still registered there. Whether the worker is known."""
        worker = self._get(worker_id, address)
        if worker is None:
            return False
        worker.heard(load)
        if events is not None:
            worker.cache.apply(*events)
        worker.last_seen = time.monotonic()
        worker.suspended = False
        return True

    def deregister(self, worker_id: str, address: str | None = None) -> None:
        """Drop a worker; with `address`, only if it is still registered there (not a worker
        that restarted under the same id)."""
        if self._get(worker_id, address) is not None:
            del self._workers[worker_id]

    def suspend(self, worker_id: str, address: str | None = None) -> None:
        """Route nothing more to the worker until it reports again (its feed broke)."""
        worker = self._get(worker_id, address)
        if worker is not None:
            worker.suspended = True

    def lost(self, worker: Worker) -> None:
        """A worker failed mid-stream (it died, or it drains): route nothing more to it; a live
        one is back at its next report. Only that incarnation: a worker restarted under the
        same id (at another address) stays."""
        self.suspend(worker.worker_id, worker.address)

    def __contains__(self, worker_id: str) -> bool:
        """Whether the worker is a member (routed to or not)."""
        return worker_id in self._workers

    def _get(self, worker_id: str, address: str | None) -> Worker | None:
        worker = self._workers.get(worker_id)
        if worker is None or (address is not None and worker.address != address):
            return None
        return worker

    def max_model_len(self) -> int | None:
        """The longest prompt + output every live worker serves (the smallest of their
        max_model_len: a request may go to any of them); None when none reports one."""
        lengths = [w.load.max_model_len for w in self.live() if w.load.max_model_len]
        return min(lengths) if lengths else None

    def live(self, role: str | None = None) -> list[Worker]:
        """Workers routed to: reported within the lease, not suspended."""
        now = time.monotonic()
        return [
            w
            for w in self._workers.values()
            if not w.suspended
            and now - w.last_seen <= self.lease_s
            and (role is None or w.role == role)
        ]
