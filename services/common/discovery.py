"""Membership of the mesh in a discovery service: workers register under a lease, every gateway
(and anything else that routes) watches the set.

One small interface (`Discovery`) and its etcd implementation (`EtcdDiscovery`), on etcd's own v3
gRPC API (the stubs of etcd's rpc.proto that the maintained `aetcd` package ships; its client
is not used, only its stubs, so the keep-alive and the watch's resumption are ours to see).
A worker puts one key, `<prefix>workers/<worker_id>`, whose value is its `WorkerEntry` (address,
role, tp, model, KV capacity), attached to a lease it renews; when it drains it deletes the key,
when it dies its lease lapses and etcd deletes the key, so every watcher sees it leave within
one TTL. A watcher gets the whole set first (`Snapshot`), then each change (`Joined`, `Left`),
and the whole set again after it lost etcd and found it back; while etcd is unreachable it gets
nothing, and keeps routing on the last view.

Load and prefix-cache events do not go through etcd: they change every half second, and each
worker streams them to the gateways that watch it (WorkerLoadFeed; docs/design-notes.md says
why, with the measurement).
"""

from __future__ import annotations

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2

log = logging.getLogger("distserve.discovery")

ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_COLOCATED: "colocated",
}
ROLE_VALUES = {v: k for k, v in ROLE_NAMES.items()}

DEFAULT_TTL_S = 6.0  # long enough for a renewal on a starved host; a dead worker leaves by then
DEFAULT_PREFIX = "/distserve/"


@dataclass(frozen=True)
class Member:
    """A worker as the discovery service holds it (gateway.proto WorkerEntry)."""

    worker_id: str
    role: str  # prefill | decode | colocated
    address: str  # host:port of its gRPC server (and of its WorkerLoadFeed)
    model: str = ""
    tensor_parallel_size: int = 1
    total_kv_blocks: int = 0
    kv_block_size: int = 16
    max_model_len: int = 0
    prefix_cache_salt: bytes = b""  # empty: no prefix cache

    def to_pb(self) -> gateway_pb2.WorkerEntry:
        fields = {**vars(self), "role": ROLE_VALUES[self.role]}
        return gateway_pb2.WorkerEntry(**fields)

    @classmethod
    def from_pb(cls, pb: gateway_pb2.WorkerEntry) -> Member:
        role = ROLE_NAMES.get(pb.role)
        if role is None or not pb.worker_id or not pb.address:
            raise ValueError(f"a worker entry needs an id, a role and an address: {pb}")
        return cls(
            worker_id=pb.worker_id,
            role=role,
            address=pb.address,
            model=pb.model,
            tensor_parallel_size=pb.tensor_parallel_size or 1,
            total_kv_blocks=pb.total_kv_blocks,
            kv_block_size=pb.kv_block_size or 16,
            max_model_len=pb.max_model_len,
            prefix_cache_salt=pb.prefix_cache_salt,
        )


@dataclass(frozen=True)
class Snapshot:
    """Every member now: replace what was known."""

    members: dict[str, Member]


@dataclass(frozen=True)
class Joined:
    """A member joined, or its entry changed (a worker restarted under the same id)."""

    member: Member


@dataclass(frozen=True)
class Left:
    """A member left: it deregistered, or its lease lapsed."""

    worker_id: str


Change = Snapshot | Joined | Left


class Discovery(ABC):
    """Register a member under a lease, renew it, deregister it; watch the members."""

    @abstractmethod
    async def register(self, member: Member) -> None:
        """Put `member` under a new lease of `ttl_s` (replacing what this client registered)."""

    @abstractmethod
    async def renew(self) -> None:
        """Keep the lease alive; register again if it lapsed (e.g. the process was stopped, or
        the discovery service lost its data). Call it well within the TTL."""

    @abstractmethod
    async def deregister(self) -> None:
        """Remove the member now (it drains)."""

    @abstractmethod
    def watch(self) -> AsyncIterator[Change]:
        """A `Snapshot`, then every change; a `Snapshot` again after a lost connection."""

    @abstractmethod
    async def close(self) -> None: ...


def etcd_target(url: str) -> str:
    """The gRPC target of an etcd client URL (`http://host:port`, or `host:port`)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--etcd takes http://HOST:PORT (plaintext gRPC), not {url!r}")
    return f"{parts.hostname}:{parts.port or 2379}"


class EtcdDiscovery(Discovery):
    """`Discovery` on etcd (v3 gRPC API). `url`: its client URL; `ttl_s`: the member's lease."""

    def __init__(
        self,
        url: str,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = DEFAULT_PREFIX,
        retry_s: float = 0.5,
    ) -> None:
        from aetcd import rpc  # etcd's v3 API stubs

        self._rpc = rpc
        self.url = url
        self.ttl_s = ttl_s
        self.retry_s = retry_s  # between tries to reach etcd again
        self._key_prefix = f"{prefix}workers/".encode()
        self._channel = grpc.aio.insecure_channel(etcd_target(url))
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)
        self._member: Member | None = None
        self._lease_id = 0

    def _key(self, worker_id: str) -> bytes:
        return self._key_prefix + worker_id.encode()

    def _range_end(self) -> bytes:
        return self._key_prefix[:-1] + bytes([self._key_prefix[-1] + 1])  # the prefix's end

    async def register(self, member: Member) -> None:
        rpc = self._rpc
        # etcd counts TTLs in whole seconds (and raises one below its minimum to it)
        grant = await self._lease.LeaseGrant(
            rpc.LeaseGrantRequest(TTL=math.ceil(self.ttl_s)), timeout=5
        )
        value = member.to_pb().SerializeToString()
        await self._kv.Put(
            rpc.PutRequest(key=self._key(member.worker_id), value=value, lease=grant.ID), timeout=5
        )
        old, self._lease_id, self._member = self._lease_id, grant.ID, member
        if old:
            await self._revoke(old)

    async def renew(self) -> None:
        if self._member is None:
            raise RuntimeError("renew before register")
        call = self._lease.LeaseKeepAlive(
            iter([self._rpc.LeaseKeepAliveRequest(ID=self._lease_id)]), timeout=5
        )
        reply = await call.read()  # one answer: the lease's TTL now (0: it lapsed)
        call.cancel()
        if reply is grpc.aio.EOF or reply.TTL <= 0:  # lapsed: etcd deleted the key with it
            log.warning("lease of %s lapsed: registering again", self._member.worker_id)
            self._lease_id = 0
            await self.register(self._member)

    async def deregister(self) -> None:
        if self._member is None:
            return
        await self._kv.DeleteRange(
            self._rpc.DeleteRangeRequest(key=self._key(self._member.worker_id)), timeout=5
        )
        lease, self._lease_id, self._member = self._lease_id, 0, None
        await self._revoke(lease)

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self._lease.LeaseRevoke(self._rpc.LeaseRevokeRequest(ID=lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:  # lapsed already: nothing held
            log.info("revoking lease %x: %s", lease_id, e.code().name)

    async def watch(self) -> AsyncIterator[Change]:
        rpc = self._rpc
        failing = False  # log a lost etcd once, not every retry
        while True:
            try:
                listed = await self._kv.Range(
                    rpc.RangeRequest(key=self._key_prefix, range_end=self._range_end()),
                    timeout=5,
                )
                if failing:
                    log.warning("etcd at %s is back: listing the members again", self.url)
                failing = False
                members = [m for m in map(self._member_of, listed.kvs) if m is not None]
                yield Snapshot({m.worker_id: m for m in members})
                create = rpc.WatchCreateRequest(
                    key=self._key_prefix,
                    range_end=self._range_end(),
                    start_revision=listed.header.revision + 1,
                )
                call = self._watch.Watch()
                await call.write(rpc.WatchRequest(create_request=create))
                async for reply in call:
                    if reply.canceled or reply.compact_revision:
                        log.warning("etcd ended the watch (%s): listing again", reply.cancel_reason)
                        call.cancel()
                        break
                    for event in reply.events:
                        if event.type == rpc.Event.PUT:
                            member = self._member_of(event.kv)
                            if member is not None:
                                yield Joined(member)
                        else:
                            yield Left(event.kv.key[len(self._key_prefix) :].decode())
            except grpc.aio.AioRpcError as e:
                if not failing:
                    log.warning("etcd at %s: %s; keeping the last view", self.url, e.code().name)
                failing = True
            await asyncio.sleep(self.retry_s)

    def _member_of(self, kv) -> Member | None:
        try:
            return Member.from_pb(gateway_pb2.WorkerEntry.FromString(kv.value))
        except Exception as e:  # not ours to crash on: another writer's key under the prefix
            log.warning("ignoring %r: not a worker entry (%s)", kv.key, e)
            return None

    async def close(self) -> None:
        await self._channel.close()
