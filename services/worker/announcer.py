"""A worker's membership in the mesh: its entry in the discovery service (etcd) under a lease it
renews, and the load feed every gateway subscribes to (its load and prefix-cache events)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common.discovery import DEFAULT_TTL_S, ROLE_NAMES, EtcdDiscovery, Member
from services.common.etcd_client import EtcdConfig
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2
from services.worker.prefix_log import PrefixCacheLog

log = logging.getLogger("distserve.announcer")

# The service every worker serves beside its own (for health checking and reflection).
LOAD_FEED_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["WorkerLoadFeed"].full_name


class LoadFeed:
    """The worker's load and prefix-cache events, every `interval_s`, to every subscribed gateway.

    One ticker takes a report (the load now, the prefix cache's changes since the last tick) and
    hands the same message to every subscriber; a new subscriber first gets the load now and the
    whole prefix cache. A subscriber that falls `max_behind` reports behind (a stuck gateway) is
    ended with RESOURCE_EXHAUSTED: it subscribes again and gets the whole set."""

    def __init__(
        self,
        load: Callable[[], common_pb2.WorkerLoad],
        prefix_cache: PrefixCacheLog | None = None,
        interval_s: float = 0.5,
        max_behind: int = 64,
    ) -> None:
        self.load = load
        self.prefix_cache = prefix_cache
        self.interval_s = interval_s
        self.max_behind = max_behind
        self._subscribers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None

    def add_to(self, server: grpc.aio.Server) -> None:
        """Serve `Watch` on `server`. Its replies are serialized once per tick, not once per
        subscriber: the handler sends the bytes as they are (no response serializer)."""
        watch = grpc.unary_stream_rpc_method_handler(
            self.Watch, request_deserializer=gateway_pb2.WatchLoadRequest.FromString
        )
        handler = grpc.method_handlers_generic_handler(LOAD_FEED_SERVICE, {"Watch": watch})
        server.add_generic_rpc_handlers((handler,))

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        """End every subscription (the worker leaves)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for queue in self._subscribers:
            queue.put_nowait(None)

    def _report(self, whole: bool) -> bytes:
        """A LoadReport, serialized."""
        report = gateway_pb2.LoadReport(load=self.load())
        if self.prefix_cache is not None:
            cache = self.prefix_cache.whole() if whole else self.prefix_cache.report()
            report.prefix_cache.CopyFrom(cache)
        return report.SerializeToString()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            report = self._report(whole=False)
            for queue in list(self._subscribers):
                if queue.qsize() < self.max_behind:
                    queue.put_nowait(report)
                else:  # ends it; it subscribes again for the whole set
                    self._subscribers.discard(queue)
                    queue.put_nowait(None)

    async def Watch(self, request, context):
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(self._report(whole=True))
        self._subscribers.add(queue)
        try:
            while (report := await queue.get()) is not None:
                yield report
        finally:
            self._subscribers.discard(queue)
        if self._task is not None and not self._task.done():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fell behind the load feed")


class Announcer:
    """Keeps `member` registered in the discovery service at `etcd`: puts it under a lease of
    `ttl_s` and renews it every third of that until stopped (registering again when the lease
    lapsed: the process was stopped, or etcd lost its data); `stop` deregisters it."""

    def __init__(self, etcd: EtcdConfig, member: Member, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.member = member
        self.discovery = EtcdDiscovery(etcd, ttl_s)
        self.interval_s = ttl_s / 3
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # etcd may still be starting
            try:
                await self.discovery.register(self.member)
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() > deadline:
                    why = self.discovery.etcd.explain(e)
                    raise RuntimeError(f"cannot register with the mesh's etcd: {why}") from e
                await asyncio.sleep(0.2)
        self._task = asyncio.create_task(self._renew())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.discovery.deregister()
        except grpc.aio.AioRpcError as e:  # its lease lapses within the TTL anyway
            log.info("deregister failed: %s", e.details())
        await self.discovery.close()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.discovery.renew()
            except grpc.aio.AioRpcError as e:
                log.warning("renewing the lease failed: %s", self.discovery.etcd.explain(e))


DRAIN_TIMEOUT_S = 30.0
# After a drain's deadline: how long the work it ended may take to unwind (free its KV).
DRAIN_SETTLE_S = 5.0


async def settle(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until `done()` or `timeout_s` passed; whether it is done."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def add_drain_args(p) -> None:
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="on SIGTERM: how long in-flight work may take to finish or hand off",
    )


async def serve_as_worker(
    *,
    server: grpc.aio.Server,
    health,
    etcd: EtcdConfig | None,
    feed: LoadFeed,
    worker_id: str,
    role: int,
    service: str,
    address: str,
    model: str,
    tensor_parallel_size: int,
    drain: Callable[[float], Awaitable[None]],
    drain_timeout_s: float,
    stop: Callable[[], Awaitable[None]],
    **ready: object,
) -> None:
    """A worker's life after its server started (with `feed` added to it): join the mesh (when an
    etcd is given: its entry, under a lease), say ready (the ready line carries its KV capacity:
    blocks, tokens, max_model_len), serve until SIGINT or SIGTERM, then drain and leave: not
    serving, deregistered (every gateway routes nothing new here), `drain(timeout)` (in-flight
    work finishes or is handed off, held KV is released, new work is refused), the feed ended,
    the server stopped, and `stop()` for the worker's own resources."""
    from services.common.server import announce_ready, wait_for_signal

    feed.start()
    start = feed.load()
    announcer = None
    if etcd:
        salt = feed.prefix_cache.salt if feed.prefix_cache is not None else b""
        member = Member(
            worker_id=worker_id,
            role=ROLE_NAMES[role],
            address=address,
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            total_kv_blocks=start.total_kv_blocks,
            kv_block_size=start.kv_block_size,
            max_model_len=start.max_model_len,
            prefix_cache_salt=salt,
        )
        announcer = Announcer(etcd, member)
        await announcer.start()
    capacity = {
        "kv_blocks": start.total_kv_blocks,
        "kv_block_size": start.kv_block_size,
        "kv_capacity_tokens": start.total_kv_blocks * start.kv_block_size,
        "max_model_len": start.max_model_len,
    }
    log.info("%s: KV capacity %s", worker_id, capacity)
    announce_ready(service, address=address, worker_id=worker_id, **capacity, **ready)
    await wait_for_signal()
    log.info("stopping %s: draining for up to %.0f s", worker_id, drain_timeout_s)
    await health.enter_graceful_shutdown()
    if announcer is not None:
        await announcer.stop()
    started = time.monotonic()
    await drain(drain_timeout_s)
    log.info("%s drained in %.2f s", worker_id, time.monotonic() - started)
    await feed.stop()
    await server.stop(grace=1)
    await stop()
