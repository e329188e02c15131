"""Membership of the mesh in a discovery service: workers register under a lease, every gateway
(and anything else that routes) watches the set.

One small interface (`Discovery`) and its etcd implementation (`EtcdDiscovery`), on etcd's own v3
gRPC API (the stubs of etcd's rpc.proto that the maintained `aetcd` package ships; its client
is not used, only its stubs, so the keep-alive and the watch's resumption are ours to see),
reached through services/common/etcd_client.py: several members, TLS, failing over.
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

import grpc

from services.common.etcd_client import REQUIRE_LEADER, EtcdClient, EtcdConfig
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2

log = logging.getLogger("distserve.discovery")

ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_COLOCATED: "colocated",
}
ROLE_VALUES = {v: k for k, v in ROLE_NAMES.items()}

DEFAULT_TTL_S = 6.0  # long enough for a renewal on a starved host; a dead worker leaves by then


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


class EtcdDiscovery(Discovery):
    """`Discovery` on etcd (v3 gRPC API). `etcd`: its members and TLS; `ttl_s`: the member's
    lease."""

    def __init__(
        self,
        etcd: EtcdConfig,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str | None = None,
        retry_s: float = 0.5,
    ) -> None:
        """`prefix`: default the configuration's (`--etcd-prefix`)."""
        prefix = prefix or etcd.prefix
        self.etcd = EtcdClient(etcd)
        self._rpc = self.etcd.rpc
        self.ttl_s = ttl_s
        self.retry_s = retry_s  # between tries to reach etcd again
        self._key_prefix = f"{prefix}workers/".encode()
        self._member: Member | None = None
        self._lease_id = 0

    def _key(self, worker_id: str) -> bytes:
        return self._key_prefix + worker_id.encode()

    def _range_end(self) -> bytes:
        return self._key_prefix[:-1] + bytes([self._key_prefix[-1] + 1])  # the prefix's end

    async def register(self, member: Member) -> None:
        rpc, etcd = self._rpc, self.etcd
        # etcd counts TTLs in whole seconds (and raises one below its minimum to it)
        grant = await etcd.call(
            lambda: etcd.lease.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=math.ceil(self.ttl_s)), timeout=5
            )
        )
        put = rpc.PutRequest(
            key=self._key(member.worker_id),
            value=member.to_pb().SerializeToString(),
            lease=grant.ID,
        )
        await etcd.call(lambda: etcd.kv.Put(put, timeout=5))
        old, self._lease_id, self._member = self._lease_id, grant.ID, member
        if old:
            await self._revoke(old)

    async def renew(self) -> None:
        if self._member is None:
            raise RuntimeError("renew before register")
        etcd = self.etcd
        # A member that does not answer within a third of the TTL is left for the next, while
        # the lease still holds.
        timeout = min(5.0, self.ttl_s / 3)

        async def keep_alive():
            call = etcd.lease.LeaseKeepAlive(
                iter([self._rpc.LeaseKeepAliveRequest(ID=self._lease_id)]), timeout=timeout
            )
            try:
                return await call.read()  # one answer: the lease's TTL now (0: it lapsed)
            finally:
                call.cancel()

        reply = await etcd.call(keep_alive)
        if reply is grpc.aio.EOF or reply.TTL <= 0:  # lapsed: etcd deleted the key with it
            log.warning("lease of %s lapsed: registering again", self._member.worker_id)
            self._lease_id = 0
            await self.register(self._member)

    async def deregister(self) -> None:
        if self._member is None:
            return
        delete = self._rpc.DeleteRangeRequest(key=self._key(self._member.worker_id))
        await self.etcd.call(lambda: self.etcd.kv.DeleteRange(delete, timeout=5))
        lease, self._lease_id, self._member = self._lease_id, 0, None
        await self._revoke(lease)

    async def _revoke(self, lease_id: int) -> None:
        try:
            revoke = self._rpc.LeaseRevokeRequest(ID=lease_id)
            await self.etcd.call(lambda: self.etcd.lease.LeaseRevoke(revoke, timeout=5))
        except grpc.aio.AioRpcError as e:  # lapsed already: nothing held
            log.info("revoking lease %x: %s", lease_id, e.code().name)

    async def watch(self) -> AsyncIterator[Change]:
        rpc = self._rpc
        etcd = self.etcd
        failing = False  # log a lost etcd once, not every retry
        hops = 0  # members moved on to since the last listing: at once, each once
        every = rpc.RangeRequest(key=self._key_prefix, range_end=self._range_end())
        while True:
            member = etcd.member
            try:
                listed = await etcd.call(lambda: etcd.kv.Range(every, timeout=5))
                member, hops = etcd.member, 0
                if failing:
                    log.warning("etcd at %s is back: listing the members again", member)
                failing = False
                members = [m for m in map(self._member_of, listed.kvs) if m is not None]
                yield Snapshot({m.worker_id: m for m in members})
                create = rpc.WatchCreateRequest(
                    key=self._key_prefix,
                    range_end=self._range_end(),
                    start_revision=listed.header.revision + 1,
                )
                call = etcd.watch.Watch(metadata=REQUIRE_LEADER)
                await call.write(rpc.WatchRequest(create_request=create))
                async for reply in call:
                    if reply.canceled or reply.compact_revision:
                        log.warning("etcd ended the watch (%s): listing again", reply.cancel_reason)
                        call.cancel()
                        break
                    for event in reply.events:
                        if event.type == rpc.Event.PUT:
                            joined = self._member_of(event.kv)
                            if joined is not None:
                                yield Joined(joined)
                        else:
                            yield Left(event.kv.key[len(self._key_prefix) :].decode())
            except grpc.aio.AioRpcError as e:
                if etcd.failed(e, member) and hops < len(etcd.config.endpoints):
                    hops += 1
                    continue  # the next member, at once: the view is listed again there
                if not failing:
                    log.warning("%s; keeping the last view", etcd.explain(e))
                failing = True
            await asyncio.sleep(self.retry_s)

    def _member_of(self, kv) -> Member | None:
        try:
            return Member.from_pb(gateway_pb2.WorkerEntry.FromString(kv.value))
        except Exception as e:  # not ours to crash on: another writer's key under the prefix
            log.warning("ignoring %r: not a worker entry (%s)", kv.key, e)
            return None

    async def close(self) -> None:
        await self.etcd.close()
