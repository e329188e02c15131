"""The gateway's report of the live workload to the planner (`Planner.ReportWorkload`).

Two samples per request: one the moment it is accepted (`arrival`: when, and its prompt's
length), so the planner sees the arrival rate now rather than a request's latency later (a burst
shows at its next decision), and one when it finishes (its lengths, its measured TTFT and TPOT;
a request that fails is not reported). A request never waits for this: samples go through a
bounded queue and are dropped (and counted) when the planner is slow or away. Samples travel in
client streams of at most `stream_samples` samples or `stream_s` seconds; the planner's reply at
the end of each stream says whether the workload drifted and what it now recommends, which is
logged. A broken stream is re-opened with backoff.

Several planner replicas (`--planner A,B`: one leads, the others stand by, services/common/
election.py) each get every sample, on a queue and stream of their own, so a standby's window is
full when it takes over and a slow one delays no other. Several gateways each report their own
requests: the planner sums them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common import mesh_tls
from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.common.server import CHANNEL_OPTIONS

log = logging.getLogger("distserve.gateway")


class PlannerFeed:
    def __init__(
        self,
        addresses: str,
        registry: CollectorRegistry,
        capacity: int = 10_000,
        stream_samples: int = 500,
        stream_s: float = 30.0,
    ) -> None:
        # host:port of each planner replica, comma-separated.
        self.addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        self.stream_samples = stream_samples
        self.stream_s = stream_s
        self._queues: dict[str, asyncio.Queue[planner_pb2.WorkloadSample]] = {
            a: asyncio.Queue(capacity) for a in self.addresses
        }
        self._tasks: list[asyncio.Task] = []
        self.samples = Counter(
            "distserve_planner_samples",
            "Workload samples for the planner, by outcome (sent, dropped).",
            ["outcome"],
            registry=registry,
        )
        self.placement_version = Gauge(
            "distserve_planner_placement_version",
            "Version of the placement the planner recommends (0: none yet).",
            registry=registry,
        )

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(a)) for a in self.addresses]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def arrived(self, arrival_unix_s: float, prompt_tokens: int) -> None:
        """A request accepted now (never blocks; dropped when the queue is full)."""
        self._put(
            planner_pb2.WorkloadSample(
                arrival_unix_s=arrival_unix_s, prompt_tokens=prompt_tokens, arrival=True
            )
        )

    def add(
        self,
        arrival_unix_s: float,
        prompt_tokens: int,
        output_tokens: int,
        ttft_s: float,
        tpot_s: float,
    ) -> None:
        """A finished request (never blocks; dropped when the queue is full)."""
        sample = planner_pb2.WorkloadSample(
            arrival_unix_s=arrival_unix_s,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            ttft_ms=ttft_s * 1000,
            tpot_ms=tpot_s * 1000,
        )
        self._put(sample)

    def _put(self, sample: planner_pb2.WorkloadSample) -> None:
        for queue in self._queues.values():
            try:
                queue.put_nowait(sample)
            except asyncio.QueueFull:
                self.samples.labels("dropped").inc()

    async def _run(self, address: str) -> None:
        backoff = 0.5
        queue = self._queues[address]
        async with mesh_tls.aio_channel(address, CHANNEL_OPTIONS) as channel:
            stub = planner_pb2_grpc.PlannerStub(channel)
            while True:
                first = await queue.get()  # no empty streams
                try:
                    reply = await stub.ReportWorkload(self._window(first, queue))
                except grpc.aio.AioRpcError as e:
                    log.warning("planner at %s: %s; retrying", address, e.code().name)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
                backoff = 0.5
                if reply.HasField("placement"):
                    self.placement_version.set(reply.placement.version)
                for reason in reply.reasons:
                    log.info(
                        "planner: workload drifted (%s); placement v%d recommended: %s",
                        reason,
                        reply.placement.version,
                        _describe(reply.placement),
                    )

    async def _window(
        self,
        first: planner_pb2.WorkloadSample,
        queue: asyncio.Queue[planner_pb2.WorkloadSample],
    ):
        """One stream's samples: up to stream_samples, or until stream_s passed."""
        end = time.monotonic() + self.stream_s
        sample, sent = first, 0
        while True:
            yield sample
            self.samples.labels("sent").inc()
            sent += 1
            left = end - time.monotonic()
            if sent >= self.stream_samples or left <= 0:
                return
            try:
                sample = await asyncio.wait_for(queue.get(), left)
            except TimeoutError:
                return


def _describe(placement: planner_pb2.Placement) -> str:
    return ", ".join(
        f"{p.role} tp={p.tensor_parallel} pp={p.pipeline_parallel} x{p.replicas}"
        for p in placement.phases
    )
