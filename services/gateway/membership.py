"""The gateway's view of the mesh, kept from the discovery service and the workers' load feeds.

Every gateway watches the discovery service (services/common/discovery.py: etcd) and subscribes
to the load feed (WorkerLoadFeed) of every worker listed there, so any number of gateways see
the same members, the same load and the same prefix-cache events; none holds state another
needs. A worker that leaves etcd (it drained, or its lease lapsed) leaves the registry; one whose
feed breaks is suspended (not routed to) until its feed reports again; while etcd is
unreachable the last view stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from services.common.discovery import Discovery, Joined, Left, Member, Snapshot
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.prefix_index import CachedBlocks
from services.gateway.registry import Load, Registry

log = logging.getLogger("distserve.gateway")


class Membership:
    """Follows `discovery`'s members into `registry`, and each member's load feed (reached
    through `channel(address)`); `retry_s` between tries to subscribe to a feed again."""

    def __init__(
        self,
        registry: Registry,
        discovery: Discovery,
        channel: Callable[[str], grpc.aio.Channel],
        retry_s: float = 0.5,
    ) -> None:
        self.registry = registry
        self.discovery = discovery
        self.channel = channel
        self.retry_s = retry_s
        self._feeds: dict[str, tuple[Member, asyncio.Task]] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        tasks = [t for _, t in self._feeds.values()]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._feeds.clear()
        await self.discovery.close()

    async def _follow(self) -> None:
        async for change in self.discovery.watch():
            if isinstance(change, Snapshot):
                for worker_id in set(self._feeds) - set(change.members):
                    self._leave(worker_id)
                for member in change.members.values():
                    self._join(member)
            elif isinstance(change, Joined):
                self._join(change.member)
            elif isinstance(change, Left):
                self._leave(change.worker_id)

    def _join(self, m: Member) -> None:
        known = self._feeds.get(m.worker_id)
        if known is not None and known[0] == m:
            return
        if known is not None:  # restarted under its id: the old incarnation's feed ends
            known[1].cancel()
        load = Load(
            free_kv_blocks=m.total_kv_blocks,
            total_kv_blocks=m.total_kv_blocks,
            kv_block_size=m.kv_block_size,
            max_model_len=m.max_model_len,
        )
        cache = CachedBlocks(m.prefix_cache_salt, m.kv_block_size)
        self.registry.register(m.worker_id, m.role, m.address, load, cache)
        self._feeds[m.worker_id] = (m, asyncio.create_task(self._feed(m)))
        log.info("%s joined (%s at %s)", m.worker_id, m.role, m.address)

    def _leave(self, worker_id: str) -> None:
        known = self._feeds.pop(worker_id, None)
        if known is not None:
            known[1].cancel()
        self.registry.deregister(worker_id)
        log.info("%s left", worker_id)

    async def _feed(self, m: Member) -> None:
        """Apply `m`'s load reports as they come; subscribe again when its feed breaks."""
        stub = gateway_pb2_grpc.WorkerLoadFeedStub(self.channel(m.address))
        while True:
            try:
                async for report in stub.Watch(gateway_pb2.WatchLoadRequest()):
                    events = report.prefix_cache
                    cache = (events.reset, events.stored, events.removed)
                    self.registry.report(m.worker_id, load_of(report.load), cache, m.address)
            except grpc.aio.AioRpcError as e:
                log.info("load feed of %s: %s", m.worker_id, e.code().name)
            self.registry.suspend(m.worker_id, m.address)
            await asyncio.sleep(self.retry_s)


def load_of(pb: common_pb2.WorkerLoad) -> Load:
    return Load(
        queued_prompt_tokens=pb.queued_prompt_tokens,
        running_seqs=pb.running_seqs,
        waiting_seqs=pb.waiting_seqs,
        free_kv_blocks=pb.free_kv_blocks,
        total_kv_blocks=pb.total_kv_blocks,
        pending_pulls=pb.pending_pulls,
        held_kv_handles=pb.held_kv_handles,
        decode_step_ms=pb.decode_step_ms,
        kv_block_size=pb.kv_block_size,
        max_model_len=pb.max_model_len,
    )
