"""Leases on held KV: who may fetch it, until when."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.common import clock
from services.common.errors import NotFound, PermissionDenied
from services.common.kv_handle import KvHandle


@dataclass
class Lease:
    """Held KV of one request: its handle, when it lapses (monotonic seconds), and how many
    chunk sends are reading its blocks right now (the blocks are freed only when none is).
    `trace` is the request's trace context, for the span of the lease's life.

    A layer-wise lease (layer-wise handoff) is created before its prompt is computed: layers
    become readable as `publish` announces them, and `first_token` resolves when prefill has
    sampled it. Closing the lease (released, lapsed, cancelled) wakes everyone waiting."""

    request_id: str
    handle: KvHandle
    expires: float
    trace: object = None
    layers_ready: int = 0
    closed: bool = False
    first_token: asyncio.Future | None = None  # (token id, prefill done unix s), layer-wise only
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=clock.monotonic)  # reported (the lease span)
    chunks_sent: int = 0
    bytes_sent: int = 0
    blocks: list[int] = field(default_factory=list)
    sends: set[asyncio.Task] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Per layer, the checksums of its blocks (ChunkSource, computed as layers are published).
    digests: dict[int, asyncio.Future] = field(default_factory=dict)
    on_publish: Callable[[Lease, int, int], None] | None = None  # (lease, layers before, after)

    def __post_init__(self) -> None:
        self.blocks = self.handle.blocks()
        self.idle.set()
        if self.handle.layerwise:
            self.first_token = asyncio.get_running_loop().create_future()
        else:
            self.layers_ready = self.handle.num_layers

    def publish(self, layers: int) -> None:
        """The first `layers` layers are computed and may be sent."""
        if layers > self.layers_ready:
            before, self.layers_ready = self.layers_ready, layers
            if self.on_publish is not None:
                self.on_publish(self, before, layers)
            self._wake()

    async def wait_layer(self, layer: int) -> None:
        """Until `layer` may be sent, or the lease closed."""
        while self.layers_ready <= layer and not self.closed:
            await self.changed.wait()

    def close(self) -> None:
        self.closed = True
        if self.first_token is not None and not self.first_token.done():
            self.first_token.set_exception(
                NotFound(f"KV handle {self.handle.handle_id} is gone before its first token")
            )
            self.first_token.exception()  # retrieved: nobody may be waiting
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def inflight(self) -> int:
        return len(self.sends)

    def begin_send(self, task: asyncio.Task) -> None:
        self.sends.add(task)
        self.idle.clear()

    def end_send(self, task: asyncio.Task) -> None:
        self.sends.discard(task)
        if not self.sends:
            self.idle.set()

    async def stop_sends(self) -> None:
        """Cancel the sends still reading this lease's blocks and wait until none is."""
        for task in list(self.sends):
            task.cancel()
        await self.idle.wait()


class LeaseTable:
    """Handles of held KV, checked by access token; lapsed leases are collected by `expired`."""

    def __init__(self, default_s: float, max_s: float) -> None:
        self.default_s = default_s
        self.max_s = max_s
        self._leases: dict[str, Lease] = {}
        self._added: asyncio.Event | None = None  # set (and replaced) when a lease is added
        # Called with (lease, layers before, layers now) whenever layers become readable,
        # including those readable when the lease is added.
        self.on_publish: Callable[[Lease, int, int], None] | None = None
        self.expired_total = 0
        self.released_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def create(self, request_id: str, template: KvHandle, trace: object = None) -> KvHandle:
        """A fresh handle (new id, new token) for `template`'s KV, leased for default_s."""
        expires = time.monotonic() + self.default_s
        handle = replace(
            template,
            handle_id=uuid.uuid4().hex,
            access_token=secrets.token_urlsafe(32),
            lease_expiry_unix_ms=_unix_ms(expires),
        )
        self._add(Lease(request_id, handle, expires, trace))
        return handle

    def adopt(self, request_id: str, handle: KvHandle, layers_ready: int) -> Lease:
        """Hold a lease on a handle made elsewhere (a follower rank serving its share of rank
        0's handle): same id and token, `layers_ready` layers published. Its life is rank 0's
        to end (pop_request); it does not lapse here before max_s."""
        lease = Lease(request_id, handle, time.monotonic() + self.max_s)
        lease.publish(layers_ready)
        self._add(lease)
        return lease

    def _add(self, lease: Lease) -> None:
        self._leases[lease.handle.handle_id] = lease
        lease.on_publish = self.on_publish
        if self.on_publish is not None and lease.layers_ready:
            self.on_publish(lease, 0, lease.layers_ready)
        if self._added is not None:
            self._added.set()
            self._added = None

    async def wait_for(self, handle_id: str, timeout_s: float) -> None:
        """Until a lease with this id is held, or timeout_s passed (then get says NotFound)."""
        deadline = time.monotonic() + timeout_s
        while handle_id not in self._leases and (left := deadline - time.monotonic()) > 0:
            if self._added is None:
                self._added = asyncio.Event()
            try:
                await asyncio.wait_for(self._added.wait(), left)
            except TimeoutError:
                return

    def of_request(self, request_id: str) -> Lease | None:
        for lease in self._leases.values():
            if lease.request_id == request_id:
                return lease
        return None

    def get(self, handle_id: str, access_token: str) -> Lease:
        """The live lease, if the token is right. NotFound if unknown or lapsed."""
        lease = self._leases.get(handle_id)
        if lease is None or lease.expires <= time.monotonic():
            raise NotFound(f"KV handle {handle_id} does not exist or its lease lapsed")
        if not hmac.compare_digest(lease.handle.access_token.encode(), access_token.encode()):
            raise PermissionDenied(f"wrong access token for KV handle {handle_id}")
        return lease

    def renew(self, handle_id: str, access_token: str, extend_ms: int) -> KvHandle:
        lease = self.get(handle_id, access_token)
        extend = min(extend_ms / 1000 if extend_ms else self.default_s, self.max_s)
        lease.expires = max(lease.expires, time.monotonic() + extend)
        lease.handle = replace(lease.handle, lease_expiry_unix_ms=_unix_ms(lease.expires))
        return lease.handle

    def pop(self, handle_id: str, access_token: str) -> Lease:
        """Remove a lease on release."""
        lease = self.get(handle_id, access_token)
        del self._leases[handle_id]
        lease.close()
        self.released_total += 1
        return lease

    def pop_request(self, request_id: str) -> Lease | None:
        """Remove the lease of a request (its KV is freed for another reason)."""
        for handle_id, lease in list(self._leases.items()):
            if lease.request_id == request_id:
                lease.close()
                return self._leases.pop(handle_id)
        return None

    def pop_all(self) -> list[Lease]:
        """Remove and return every lease (an instance that drains out of time)."""
        out = list(self._leases.values())
        self._leases.clear()
        for lease in out:
            lease.close()
        return out

    def expired(self) -> list[Lease]:
        """Remove and return the leases that lapsed."""
        now = time.monotonic()
        # A lease whose blocks are being sent lapses once the send is over.
        out = [
            lease for lease in self._leases.values() if lease.expires <= now and not lease.inflight
        ]
        for lease in out:
            del self._leases[lease.handle.handle_id]
            lease.close()
        self.expired_total += len(out)
        return out


def _unix_ms(monotonic_s: float) -> int:
    return int((time.time() + (monotonic_s - time.monotonic())) * 1000)
