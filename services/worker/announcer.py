"""A worker's membership in the mesh: register with the gateway, heartbeat its load, leave."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common import mesh_tls
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.server import CHANNEL_OPTIONS
from services.worker.prefix_log import PrefixCacheLog

log = logging.getLogger("distserve.announcer")


class Announcer:
    """Registers a worker and heartbeats `load()` until stopped; re-registers when the gateway
    forgets it (e.g. after a gateway restart). With a `prefix_cache` log, each heartbeat also
    carries what the worker's prefix cache stored and evicted (services/worker/prefix_log.py)."""

    def __init__(
        self,
        gateway: str,
        *,
        worker_id: str,
        role: int,
        address: str,
        model: str,
        load: Callable[[], common_pb2.WorkerLoad],
        interval_s: float = 0.5,
        prefix_cache: PrefixCacheLog | None = None,
    ) -> None:
        self.gateway = gateway
        self.request = gateway_pb2.RegisterRequest(
            worker_id=worker_id,
            role=role,
            address=address,
            model=model,
            prefix_cache_salt=prefix_cache.salt if prefix_cache is not None else b"",
        )
        self.load = load
        self.prefix_cache = prefix_cache
        self.interval_s = interval_s
        self.timeout_s = 1.0  # of one heartbeat; half the lease once the gateway said it
        self._channel = mesh_tls.aio_channel(gateway, CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.WorkerRegistryStub(self._channel)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._register()
        self._task = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self._stub.Deregister(
                gateway_pb2.DeregisterRequest(worker_id=self.request.worker_id), timeout=2
            )
        except grpc.aio.AioRpcError as e:
            log.info("deregister failed: %s", e.details())
        await self._channel.close()

    async def _register(self) -> None:
        self.request.load.CopyFrom(self.load())
        if self.prefix_cache is not None:
            self.request.prefix_cache.CopyFrom(self.prefix_cache.report(whole=True))
        try:
            reply = await self._stub.Register(self.request, timeout=10, wait_for_ready=True)
        except grpc.aio.AioRpcError:
            if self.prefix_cache is not None:
                self.prefix_cache.lost()
            raise
        self.interval_s = min(self.interval_s, reply.lease_ms / 3000)
        # A slow answer still counts: a heartbeat given up at 1 s on a starved host let a live
        # worker's lease lapse. Half the lease leaves time for the next one.
        self.timeout_s = max(1.0, reply.lease_ms / 2000)

    async def _beat(self) -> None:
        beat = gateway_pb2.HeartbeatRequest(worker_id=self.request.worker_id)
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                beat.load.CopyFrom(self.load())
                if self.prefix_cache is not None:
                    beat.prefix_cache.CopyFrom(self.prefix_cache.report())
                reply = await self._stub.Heartbeat(beat, timeout=self.timeout_s)
                if not reply.known:
                    await self._register()
            except grpc.aio.AioRpcError as e:
                if self.prefix_cache is not None:
                    self.prefix_cache.lost()  # its changes may not have arrived
                log.warning("heartbeat to %s failed: %s", self.gateway, e.code().name)


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
    gateway: str | None,
    worker_id: str,
    role: int,
    service: str,
    address: str,
    model: str,
    load: Callable[[], common_pb2.WorkerLoad],
    drain: Callable[[float], Awaitable[None]],
    drain_timeout_s: float,
    stop: Callable[[], Awaitable[None]],
    prefix_cache: PrefixCacheLog | None = None,
    **ready: object,
) -> None:
    """A worker's life after its server started: join the mesh (when a gateway is given), say
    ready (the ready line carries its KV capacity: blocks, tokens, max_model_len), serve until
    SIGINT or SIGTERM, then drain and leave: not serving, deregistered (the gateway routes
    nothing new here), `drain(timeout)` (in-flight work finishes or is handed off, held KV is
    released, new work is refused), the server stopped, and `stop()` for the worker's own
    resources."""
    from services.common.server import announce_ready, wait_for_signal

    announcer = None
    if gateway:
        announcer = Announcer(
            gateway,
            worker_id=worker_id,
            role=role,
            address=address,
            model=model,
            load=load,
            prefix_cache=prefix_cache,
        )
        await announcer.start()
    start = load()
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
    await server.stop(grace=1)
    await stop()
