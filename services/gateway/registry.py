"""The workers the gateway routes to, kept alive by heartbeats, and the routing rules.

Routing weighs load and, for a worker with a prefix cache, the part of the prompt it holds
(gateway/prefix_index.py): a prefill instance is chosen by the prompt tokens it would compute
before this prompt's first token (its queue plus the prompt's uncached part), and a decode or
colocated instance, among those within a few requests of the least loaded, by the prefix it
already holds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common import telemetry
from services.common.errors import Unavailable
from services.gateway.prefix_index import CachedBlocks, PromptBlocks

# A decode or colocated instance holding more of a prompt is preferred over the least loaded
# one if it has at most this many more requests open: one request more in a decode batch costs
# its others little, and a cached prefix saves pulling (or computing) that part of the prompt.
DECODE_AFFINITY_SLACK = 2


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
    last_seen: float = field(default_factory=time.monotonic)
    cache: CachedBlocks = field(default_factory=CachedBlocks)  # its prefix cache, as reported
    # The calls this gateway has open on the worker, by ticket: exact and current for its own
    # work. A heartbeat's load is a snapshot the worker took a moment ago (its engine only sees
    # a call between two steps), so it misses calls just sent and still shows calls that have
    # just ended; what it shows beyond what this gateway had open when it came is other
    # gateways' work. The worker's figures are this gateway's own plus those others'.
    _calls: dict[int, _Call] = field(default_factory=dict, repr=False)
    _tickets: itertools.count = field(default_factory=itertools.count, repr=False)
    # (queued tokens, waiting, open) of this gateway's own calls when the last heartbeat came
    _own_at_heartbeat: tuple[int, int, int] = (0, 0, 0)

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
        """A heartbeat's load: remember what of it was this gateway's own work."""
        self.load = load
        self._own_at_heartbeat = self._own()

    def _reported(self) -> tuple[int, int, int]:
        load = self.load
        return (
            load.queued_prompt_tokens,
            load.pending_pulls,
            load.running_seqs + load.waiting_seqs + load.pending_pulls,
        )

    def _now(self, i: int) -> int:
        """Figure i (queued tokens, waiting, open) now: this gateway's own, plus what the last
        heartbeat showed beyond this gateway's own at the time (other gateways' work)."""
        own = self._own()[i]
        return own + max(0, self._reported()[i] - self._own_at_heartbeat[i])

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
        moment, where a heartbeat's free blocks are a snapshot of a moment ago: routing on
        the snapshot made two runs of one workload route differently wherever instances tie
        on open requests (other gateways' requests count in `open_requests`)."""
        held = sum(c.kv_tokens for c in self._calls.values() if not c.waiting)
        return self.load.total_kv_blocks * self.load.kv_block_size - held


ROUTING = ("prefix", "load", "round-robin")  # see Registry


class Registry:
    """Workers by id; a worker whose lease lapses (no heartbeat) is dropped from routing.

    `routing`: "prefix" weighs each worker's cached prefix of the prompt and its load (the
    default); "load" the load alone; "round-robin" takes the workers of a role in turn (both
    for comparison)."""

    def __init__(self, lease_s: float = 3.0, routing: str = "prefix") -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, not {routing!r}")
        self.lease_s = lease_s
        self.routing = routing
        self._workers: dict[str, Worker] = {}
        self._turns: dict[str, int] = {}  # round-robin: picks so far, by role
        # Prompt tokens routed, by (role, kind): "prompt" all of them, "cached" those the chosen
        # worker holds, "best" those the worker holding the most of each prompt holds.
        self.prefix_tokens: dict[tuple[str, str], int] = {}

    def register(
        self, worker_id: str, role: str, address: str, load: Load, cache: CachedBlocks | None = None
    ) -> None:
        """A worker joins (or joins again: what was known of it is replaced)."""
        worker = Worker(worker_id, role, address, load, cache=cache or CachedBlocks())
        worker.cache.block_size = load.kv_block_size
        self._workers[worker_id] = worker

    def heartbeat(
        self,
        worker_id: str,
        load: Load,
        events: tuple[bool, Iterable[int], Iterable[int]] | None = None,
    ) -> bool:
        """A worker's heartbeat: its load, and its prefix cache's (reset, stored, removed)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.heard(load)
        if events is not None:
            worker.cache.apply(*events)
        worker.last_seen = time.monotonic()
        return True

    def deregister(self, worker_id: str, address: str | None = None) -> None:
        """Drop a worker; with `address`, only if it is still registered there (not a worker
        that restarted under the same id)."""
        worker = self._workers.get(worker_id)
        if worker is not None and (address is None or worker.address == address):
            del self._workers[worker_id]

    def lost(self, worker: Worker) -> None:
        """A worker failed mid-stream (it died, or it drains): route nothing more to it; a live
        one is back at its next heartbeat. Only that incarnation: a worker restarted under the
        same id (at another address) stays."""
        self.deregister(worker.worker_id, worker.address)

    def live(self, role: str | None = None) -> list[Worker]:
        """Workers whose lease holds; lapsed ones are removed."""
        now = time.monotonic()
        for worker_id, w in list(self._workers.items()):
            if now - w.last_seen > self.lease_s:
                del self._workers[worker_id]
        return [w for w in self._workers.values() if role is None or w.role == role]

    def pick_prefill(
        self, exclude: set[str] | frozenset[str] = frozenset(), prompt: PromptBlocks | None = None
    ) -> Worker:
        """The prefill instance that would reach `prompt`'s first token soonest: the fewest
        prompt tokens to compute there first (queued ones, then the prompt's part not in its
        prefix cache); without a prompt, the fewest queued. Instances not in `exclude` (those a
        request already tried) are preferred."""
        workers = self.live("prefill")
        if not workers:
            raise Unavailable("no prefill instance is registered with the gateway")
        workers = [w for w in workers if w.worker_id not in exclude] or workers
        if self.routing == "round-robin":
            return self._turn("prefill", workers)
        if prompt is None or self.routing == "load":
            return min(workers, key=lambda w: (w.queued_tokens, w.worker_id))
        n = len(prompt.token_ids)

        def first_token_after(w: Worker) -> int:  # prompt tokens computed there first
            return w.queued_tokens + n - prompt.cached_tokens(w.cache)

        return min(workers, key=lambda w: (first_token_after(w), w.worker_id))

    def pick_decode(
        self,
        role: str = "decode",
        exclude: set[str] | frozenset[str] = frozenset(),
        prompt: PromptBlocks | None = None,
    ) -> Worker:
        """The least-loaded decode (or colocated) instance: fewest sequences running, waiting
        or being pulled; then the most KV headroom (`Worker.kv_headroom_tokens`). With a
        `prompt`, of the instances within `DECODE_AFFINITY_SLACK` requests of the least
        loaded, the one holding the longest prefix of it. Instances in `exclude` (those a
        request already failed on) only when there is no other."""
        workers = self.live(role)
        if not workers:
            raise Unavailable(f"no {role} instance is registered with the gateway")
        workers = [w for w in workers if w.worker_id not in exclude] or workers
        if self.routing == "round-robin":
            return self._turn(role, workers)

        def load(w: Worker) -> tuple:
            return (w.open_requests, -w.kv_headroom_tokens, w.worker_id)

        if prompt is None or self.routing == "load":
            return min(workers, key=load)
        least = min(w.open_requests for w in workers)
        near = [w for w in workers if w.open_requests <= least + DECODE_AFFINITY_SLACK]
        return min(near, key=lambda w: (-prompt.cached_tokens(w.cache), *load(w)))

    def _turn(self, role: str, workers: list[Worker]) -> Worker:
        n = self._turns[role] = self._turns.get(role, -1) + 1
        return sorted(workers, key=lambda w: w.worker_id)[n % len(workers)]

    def routed(self, trace, worker: Worker, prompt: PromptBlocks) -> int:
        """`prompt` goes to `worker`: its blocks count as held there from now on, and the
        prompt tokens cached there (and the most any worker of its role holds) go on the
        request's span (`distserve.<role>.cached_tokens`, `...best_cached_tokens`) and into
        `prefix_tokens`. Returns the tokens cached there."""
        role = worker.role
        cached = prompt.cached_tokens(worker.cache)
        best = max((prompt.cached_tokens(w.cache) for w in self.live(role)), default=0)
        best = max(best, cached)
        for kind, n in (("prompt", len(prompt.token_ids)), ("cached", cached), ("best", best)):
            self.prefix_tokens[role, kind] = self.prefix_tokens.get((role, kind), 0) + n
        if worker.cache.enabled:
            telemetry.annotate(
                trace,
                {
                    f"distserve.{role}.cached_tokens": cached,
                    f"distserve.{role}.best_cached_tokens": best,
                },
            )
            worker.cache.predict(prompt.hashes(worker.cache))
        return cached

    def mode(self) -> str:
        """How requests are served now: disaggregated when both pools exist, else colocated."""
        if self.live("prefill") and self.live("decode"):
            return "disaggregated"
        if self.live("colocated"):
            return "colocated"
        raise Unavailable(
            "no complete serving path: register a prefill and a decode instance, or a colocated one"
        )
