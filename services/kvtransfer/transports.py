"""How chunks travel: UCX (zero-copy into the destination) or the gRPC fallback.

`fetch(handle, source, request, buffers, window, timeout_s, checksums, lane)` asks a source rank
for the request's chunks (up to `max_chunks`) over one of the transport's `lanes` (UCX: a
connection from each of the puller's workers, whose copies run in parallel) and fills `buffers`
with their bytes, each received once the pull's `Window` has room for it and within `timeout_s`
of its start; it returns a `Fetched`: the source's status, if it came, and per chunk whether its
bytes arrived and, with `checksums`, their CRC-32C as received (over UCX, taken by the thread
that copied the chunk as soon as it arrived). A broken connection is forgotten, so the next
attempt reconnects. Retries and the checks are the puller's.

Why one file (~350 lines): the two transports answer one call (`fetch`) and fill the same
`Window` and `Fetched`; side by side, a reader sees what the fallback does differently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import grpc
import numpy as np

from services.common.errors import Unavailable
from services.common.gen.distserve.v1 import kvtransfer_pb2_grpc
from services.common.kv_handle import KvHandle, RankSource
from services.kvtransfer import ucx_loop, wire
from services.kvtransfer.checksums import checksum, checksum_of

log = logging.getLogger("distserve.kvtransfer")

# After a failed or abandoned attempt, how long to wait for the source's answer to it before
# the endpoint is given up (aborting it is the only way to be sure nothing lands later).
DRAIN_S = 0.25


@dataclass
class Fetched:
    """What one request brought: the source's status (None when none came) and, per chunk,
    why its bytes did not arrive (None: they did) and their checksum as received."""

    status: wire.ChunkStatus | None
    errors: list[BaseException | None]
    digests: list[int | None]


class Window:
    """The chunks one pull may have in flight (their receives posted), granted in the order
    asked (the pull asks layer by layer). A grant is a callback, so a chunk's arrival posts the
    next receive at once, without a task per chunk.

    A limit in bytes as well (large chunks one at a time, each checksummed while the next is
    copied) measured no faster, 8 MiB against none at 1-256 MiB, but on the first version of
    bench/experiments/kvtransfer_ab.py, whose start-order bias favoured the unlimited side by
    5-10%: not settled either way."""

    def __init__(self, chunks: int) -> None:
        self.chunks = max(1, chunks)
        self.in_flight = 0
        self._asked: deque[list] = deque()  # [grant], grant None once withdrawn

    def ask(self, grant: Callable[[], None]) -> Callable[[], None]:
        """Call `grant()` once a chunk may be received (at once if there is room and nobody
        asked before); returns a function that withdraws the ask if it has not been granted
        yet. A granted chunk is `release`d when it leaves the window."""
        entry = [grant]
        self._asked.append(entry)
        self._grant()

        def withdraw() -> None:
            entry[0] = None

        return withdraw

    def release(self) -> None:
        self.in_flight -= 1
        self._grant()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """A chunk's place in the window, for as long as the block runs."""
        granted = asyncio.get_running_loop().create_future()
        taken = False

        def grant() -> None:
            nonlocal taken
            taken = True
            if not granted.done():  # not cancelled meanwhile
                granted.set_result(None)

        withdraw = self.ask(grant)
        try:
            await granted
            yield
        finally:
            withdraw()
            if taken:  # granted, even if cancelled before it could enter
                self.release()

    def _grant(self) -> None:
        while self._asked and self.in_flight < self.chunks:
            (grant,) = self._asked.popleft()
            if grant is not None:
                self.in_flight += 1
                grant()


class UcxTransport:
    """One cached endpoint per peer and lane; a request frame for many chunks, their raw bytes
    received straight into the destination, then one status frame. UCX runs on the event loop
    with one lane, and with more each lane on a thread of its own (`_worker`;
    services/kvtransfer/ucx_loop.py, which keeps each buffer given to a receive until UCX
    completes it: a receive given up on can never write into freed memory). Between processes
    of one host the receiver makes the copy (CMA): with two lanes, a pull's chunks are copied on
    two cores."""

    name = "ucx"
    max_chunks = wire.MAX_CHUNKS

    def __init__(self, lanes: int = 1) -> None:
        self.lanes = max(1, lanes)
        self._endpoints: dict[tuple[str, int, int], ucx_loop.UcxEndpoint] = {}
        self._connecting: dict[tuple[str, int, int], asyncio.Lock] = {}
        self._connected: set[tuple[str, int, int]] = set()  # peers reached before
        self._next_tag = 1
        self.reconnects = 0

    async def warm_up(self, host: str = "127.0.0.1") -> None:
        """Connect once to ourselves from each lane: a worker's first UCX connection sets up
        the worker and its transports (measured: ~180 ms here, then ~3-60 ms per new peer),
        which would otherwise land in the first request's handoff."""
        accepted = asyncio.Queue()

        async def accept(ep) -> None:
            ep.abort()
            accepted.put_nowait(None)

        listener = ucx_loop.worker().listen(accept, host=host)
        try:
            for lane in range(self.lanes):
                connecting = self._worker(lane).connect(_connectable(host), listener.port)
                ep = await asyncio.wait_for(connecting, 5)
                await asyncio.wait_for(accepted.get(), 5)
                ep.abort()
        finally:
            listener.close()

    async def fetch(
        self,
        handle: KvHandle,
        source: RankSource,
        request,
        buffers: list,
        window: Window,
        timeout_s: float,
        checksums: bool = False,
        lane: int = 0,
    ) -> Fetched:
        key = (source.ucx_host, source.ucx_port, lane)
        try:
            ep = await asyncio.wait_for(self._endpoint(*key), timeout_s)
        except TimeoutError:
            raise Unavailable(
                f"no connection to the KV source at {key[0]}:{key[1]} within {timeout_s} s"
            ) from None
        tag, self._next_tag = self._next_tag, self._next_tag + len(buffers)
        if 2 * self._next_tag + 1 > ucx_loop.TAG_MASK:  # tags live in 32 bits: wrap around
            self._next_tag = 1
        request.tag = tag
        status_frame = wire.empty_frame()
        # Posted before the request goes out (a refusal comes at once); each data receive is
        # posted once the window has room (by the completion of the one before it, without a
        # task per chunk), and the source's send waits for it.
        status_recv = ep.recv(status_frame, 2 * tag)
        loop = asyncio.get_running_loop()
        n = len(buffers)
        receives: list[asyncio.Future] = []
        errors: list[BaseException | None] = [None] * n
        digests: list[int | None] = [None] * n
        finished = [False] * n
        left = [n]
        settled = loop.create_future()  # every chunk arrived, failed or ran late

        def finish(i: int, error: BaseException | None) -> bool:
            """Chunk i leaves the window: arrived (error None), failed or late; False if it
            had left already (it ran late: what arrives afterwards is not used)."""
            if finished[i]:
                return False
            finished[i] = True
            errors[i] = error
            window.release()
            left[0] -= 1
            if not left[0]:
                settled.set_result(None)
            return True

        # Each chunk is hashed as soon as it arrived, by the thread that copied it (the loop, or
        # a lane's: ucx_loop), while its bytes are likely still in cache.
        hash_it = checksum_of if checksums else None

        def arrived(i: int, timer: asyncio.TimerHandle, recv: asyncio.Future) -> None:
            timer.cancel()
            error = recv.exception()  # the connection broke: closed, reset, peer gone
            if finish(i, error) and error is None:
                digests[i] = recv.result()

        def post(i: int) -> None:
            # A receive is never cancelled, only its endpoint (see UcxTransport).
            recv = ep.recv(buffers[i], 2 * (tag + i) + 1, hash_it)
            receives.append(recv)
            late = loop.call_later(
                timeout_s, finish, i, TimeoutError(f"no data within {timeout_s} s")
            )
            recv.add_done_callback(partial(arrived, i, late))

        asked: list[Callable[[], None]] = []
        status = None
        broken = False
        try:
            await asyncio.wait_for(ep.send(wire.encode(request)), timeout_s)
            # Asked for once the request is out: the source works on it meanwhile.
            asked = [window.ask(partial(post, i)) for i in range(n)]
            await settled
            await asyncio.wait((status_recv,), timeout=timeout_s)
            if not status_recv.done():
                raise TimeoutError(f"no status within {timeout_s} s")
            status_recv.result()  # raises when the connection broke
            status = wire.decode(status_frame, wire.ChunkStatus)
        except Exception as e:  # no status: late, or the connection broke
            broken = not isinstance(e, TimeoutError)
            errors = [error or e for error in errors]
        finally:
            for withdraw in asked:  # those not posted yet never will be
                withdraw()
            # Nothing of this attempt may land in the destination afterwards: if every receive
            # completes at once the endpoint is clean and stays (other pulls share it); if not
            # (a chunk never sent, a late source) or it broke, it is dropped and aborted: UCX
            # then completes what is still posted with an error.
            broken = broken or any(
                e is not None and not isinstance(e, TimeoutError) for e in errors
            )
            if not await _drained(status_recv, *receives) or broken:
                self._drop(key, ep)
        return Fetched(status, errors, digests)

    async def close(self) -> None:
        for ep in self._endpoints.values():
            ep.abort()
        self._endpoints.clear()

    def _worker(self, lane: int) -> ucx_loop.UcxWorker:
        """A lane's UCX worker: the event loop's when there is one lane; with more, each a
        thread's of its own, the loop keeping only the bookkeeping. With the loop copying one
        lane's chunks among its other work (in 512 KiB pieces, so that it goes on meanwhile),
        that lane was the slower: 1 GiB pulls, 64 chunks a lane, the loop's done 25-35 ms after
        the thread's, and the pull 176-182 ms against 160-167 with two threads."""
        return ucx_loop.worker(lane + 1 if self.lanes > 1 else 0)

    async def _endpoint(self, host: str, port: int, lane: int) -> ucx_loop.UcxEndpoint:
        """The cached endpoint to a peer from one lane, connecting (again) when there is none
        or it closed: a peer that restarted gets a fresh endpoint, never stale state. A
        connection given up on (the caller's timeout) is aborted, its handshake's buffers kept
        until UCX is done."""
        key = (host, port, lane)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(key)
            if ep is not None and not ep.closed:
                return ep
            try:
                ep = await self._worker(lane).connect(host, port)
            except ConnectionError as e:
                raise Unavailable(f"cannot reach the KV source at {host}:{port}: {e}") from e
            if key in self._connected:
                self.reconnects += 1
            self._connected.add(key)
            self._endpoints[key] = ep
            return ep

    def _drop(self, key: tuple[str, int, int], ep: ucx_loop.UcxEndpoint) -> None:
        """Forget a broken endpoint (only if it is still the cached one) and abort it."""
        if self._endpoints.get(key) is ep:
            del self._endpoints[key]
        ep.abort()


async def _drained(*receives: asyncio.Future) -> bool:
    """Whether an attempt's posted receives completed without error (waiting up to DRAIN_S for
    those still pending); they are never cancelled (see UcxTransport). Judged by
    their state, not by whether a wait ended first: a `wait_for` over receives that had all
    completed could still time out on a loop busy for longer than DRAIN_S (seen under 2x CPU
    oversubscription), and the healthy endpoint every other pull shared was then dropped."""
    pending = [r for r in receives if not r.done()]
    if pending:
        await asyncio.wait(pending, timeout=DRAIN_S)
    return all(r.done() and not r.cancelled() and r.exception() is None for r in receives)


class GrpcTransport:
    """The fallback: KvTransfer.FetchChunk on the source's control address, one chunk a call,
    the bytes copied."""

    name = "grpc"
    max_chunks = 1
    lanes = 1

    def __init__(self, channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._channel = channel
        self.reconnects = 0

    @staticmethod
    def serves(handle: KvHandle) -> bool:
        return bool(handle.control_address)

    async def fetch(
        self,
        handle: KvHandle,
        source: RankSource,
        request,
        buffers: list,
        window: Window,
        timeout_s: float,
        checksums: bool = False,
        lane: int = 0,
    ) -> Fetched:
        (dst,) = buffers
        stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(handle.control_address))
        async with window.slot():
            try:
                reply = await stub.FetchChunk(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                return Fetched(None, [Exception(f"{e.code().name}: {e.details()}")], [None])
        received = None
        if reply.status.ok and len(reply.data) == dst.nbytes:
            host = np.frombuffer(reply.data, dtype=np.uint8)
            if checksums:  # the bytes as they came, before they go to the device, if they do
                received = await checksum(host)
            if isinstance(dst, np.ndarray):
                np.copyto(dst, host)
            else:  # a uint8 tensor in device memory (memory.raw)
                import torch

                dst.copy_(torch.from_numpy(host.copy()))
        return Fetched(reply.status, [None], [received])

    async def close(self) -> None:
        pass


def _connectable(host: str) -> str:
    """An address to reach a listener bound to all interfaces on `host`'s side."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)
