"""A worker's membership in the mesh: register with the gateway, heartbeat its load, leave."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.server import CHANNEL_OPTIONS

log = logging.getLogger("distserve.announcer")


class Announcer:
    """Registers a worker and heartbeats `load()` until stopped; re-registers when the gateway
    forgets it (e.g. after a gateway restart)."""

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
    ) -> None:
        self.gateway = gateway
        self.request = gateway_pb2.RegisterRequest(
            worker_id=worker_id, role=role, address=address, model=model
        )
        self.load = load
        self.interval_s = interval_s
        self._channel = grpc.aio.insecure_channel(gateway, options=CHANNEL_OPTIONS)
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
        reply = await self._stub.Register(self.request, timeout=10, wait_for_ready=True)
        self.interval_s = min(self.interval_s, reply.lease_ms / 3000)

    async def _beat(self) -> None:
        beat = gateway_pb2.HeartbeatRequest(worker_id=self.request.worker_id)
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                beat.load.CopyFrom(self.load())
                reply = await self._stub.Heartbeat(beat, timeout=max(1.0, self.interval_s))
                if not reply.known:
                    await self._register()
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat to %s failed: %s", self.gateway, e.code().name)


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
    stop: Callable[[], Awaitable[None]],
    **ready: object,
) -> None:
    """A worker's life after its server started: join the mesh (when a gateway is given), say
    ready, serve until SIGINT or SIGTERM, then leave: not serving, deregistered, server stopped
    with a grace period, and `stop()` for the worker's own resources."""
    from services.common.server import announce_ready, wait_for_signal

    announcer = None
    if gateway:
        announcer = Announcer(
            gateway, worker_id=worker_id, role=role, address=address, model=model, load=load
        )
        await announcer.start()
    announce_ready(service, address=address, worker_id=worker_id, **ready)
    await wait_for_signal()
    log.info("stopping %s", worker_id)
    await health.enter_graceful_shutdown()
    if announcer is not None:
        await announcer.stop()
    await server.stop(grace=5)
    await stop()
