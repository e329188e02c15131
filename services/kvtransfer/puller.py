"""The data plane's client side: pulls a handle's KV into local blocks over UCX.

The handle's blocks and the destination blocks are paired in order; each chunk is one layer's K
or V for a range that is consecutive on both sides (at most `chunk_bytes`), received straight
into the destination region. Up to `window` chunks are in flight. Each chunk is checked against
the checksum the source sends and has its own timeout; a late, failed or corrupt chunk alone is
fetched again (bounded attempts, exponential backoff with jitter, a fresh endpoint after a
transport fault). The lease is renewed while the pull runs. A pull that gives up raises, and the
caller must not use the destination: partial KV is never decoded from.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import ucxx
import xxhash

from services.common.errors import (
    DistServeError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from services.common.gen.distserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.kv_handle import KvHandle
from services.common.server import CHANNEL_OPTIONS
from services.kvtransfer import wire

log = logging.getLogger("distserve.kvtransfer")

RegionFn = Callable[[int, int, int, int], object]


def segments(src: list[int], dst: list[int], max_blocks: int) -> list[tuple[int, int, int]]:
    """(index into the handle's blocks, first destination block id, count) of each range that is
    consecutive in both block lists, at most max_blocks long."""
    out = []
    i = 0
    while i < len(src):
        n = 1
        while (
            i + n < len(src)
            and n < max_blocks
            and src[i + n] == src[i] + n
            and dst[i + n] == dst[i] + n
        ):
            n += 1
        out.append((i, dst[i], n))
        i += n
    return out


@dataclass(frozen=True)
class PullPolicy:
    """How a pull copes with faults."""

    chunk_bytes: int = 4 * 2**20  # largest chunk
    window: int = 4  # chunks in flight per pull
    chunk_timeout_s: float = 10.0  # one attempt at one chunk
    attempts: int = 4  # per chunk, the first included
    backoff_s: float = 0.05  # first retry waits about this long, doubling each time
    verify: bool = True  # check each chunk's checksum


class ChecksumMismatch(Exception):
    """A chunk arrived with bytes that do not match the source's checksum."""


class _Refused(Exception):
    """The source answered and said no; retrying cannot help."""

    def __init__(self, error: DistServeError) -> None:
        super().__init__(str(error))
        self.error = error


class KvPuller:
    """Pulls KV from prefill instances; keeps one UCX endpoint and gRPC channel per peer."""

    def __init__(self, policy: PullPolicy | None = None) -> None:
        self.policy = policy or PullPolicy()
        self._endpoints: dict[tuple[str, int], object] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._connected: set[tuple[str, int]] = set()  # peers reached before
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tags = itertools.count(1)
        self.chunks_retried = 0
        self.checksum_failures = 0
        self.reconnects = 0
        self.lease_renewals = 0

    async def pull(self, handle: KvHandle, dst_blocks: list[int], dst_region: RegionFn) -> int:
        """Fill dst_blocks with the handle's KV; returns the bytes received.

        Raises Unavailable when the source cannot be reached or a chunk runs out of attempts,
        PermissionDenied or NotFound when the source refuses the handle.
        """
        src_blocks = handle.blocks()
        if len(src_blocks) != len(dst_blocks):
            raise InvalidRequest(
                f"handle has {len(src_blocks)} blocks, destination {len(dst_blocks)}"
            )
        per_chunk = max(1, self.policy.chunk_bytes // max(1, handle.block_bytes))
        segs = segments(src_blocks, dst_blocks, per_chunk)
        jobs = [
            (layer, kv, seg) for layer in range(handle.num_layers) for kv in (0, 1) for seg in segs
        ]
        gate = asyncio.Semaphore(self.policy.window)

        async def one(layer: int, kv: int, seg: tuple[int, int, int]) -> int:
            async with gate:
                return await self._chunk_with_retries(handle, layer, kv, seg, dst_region)

        renewer = asyncio.ensure_future(self._keep_lease(handle))
        tasks = [asyncio.ensure_future(one(*job)) for job in jobs]
        try:
            return sum(await asyncio.gather(*tasks))
        finally:
            for t in [*tasks, renewer]:  # on failure, stop the rest: nothing writes after this
                t.cancel()

    async def _chunk_with_retries(self, handle: KvHandle, layer: int, kv: int, seg, dst_region):
        policy = self.policy
        where = f"{handle.source_instance} ({handle.ucx_host}:{handle.ucx_port})"
        error: BaseException | None = None
        for attempt in range(policy.attempts):
            if attempt:
                self.chunks_retried += 1
                # Exponential backoff with full jitter, so retries of many chunks spread out.
                await asyncio.sleep(policy.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                ep = await self._endpoint(handle.ucx_host, handle.ucx_port)
            except Unavailable as e:
                error = e
                continue
            try:
                return await asyncio.wait_for(
                    self._chunk(ep, handle, layer, kv, seg, dst_region), policy.chunk_timeout_s
                )
            except _Refused as e:
                raise e.error from None
            except ChecksumMismatch as e:
                self.checksum_failures += 1
                error = e
            except TimeoutError:
                # Late: drop the endpoint so nothing of this attempt can land after a retry.
                self._drop(handle.ucx_host, handle.ucx_port, ep)
                error = TimeoutError(f"no answer within {policy.chunk_timeout_s} s")
            except Exception as e:  # the endpoint broke: closed, reset, peer gone
                self._drop(handle.ucx_host, handle.ucx_port, ep)
                error = e
            log.warning(
                "KV chunk layer %d kv %d from %s failed (attempt %d of %d): %s",
                layer,
                kv,
                where,
                attempt + 1,
                policy.attempts,
                error,
            )
        raise Unavailable(f"KV pull from {where} failed after {policy.attempts} attempts: {error}")

    async def _chunk(self, ep, handle: KvHandle, layer: int, kv: int, seg, dst_region) -> int:
        src_index, dst_first, n = seg
        tag = next(self._tags)
        request = wire.ChunkRequest(
            handle_id=handle.handle_id,
            access_token=handle.access_token,
            layer=layer,
            kv=kv,
            first_block=src_index,
            num_blocks=n,
            tag=tag,
        )
        dst = dst_region(layer, kv, dst_first, n)
        status_frame = wire.empty_frame()
        # Both receives are posted before the request goes out: one round trip per chunk. A
        # refusal comes with a one-byte filler, which completes the data receive.
        status_recv = asyncio.ensure_future(ep.recv(status_frame, tag=2 * tag))
        data_recv = asyncio.ensure_future(ep.recv(dst, tag=2 * tag + 1))
        try:
            await ep.send(wire.encode(request))
            await status_recv
            status = wire.decode(status_frame, wire.ChunkStatus)
            await data_recv
        finally:
            for f in (status_recv, data_recv):
                f.cancel()
        if not status.ok:
            raise _Refused(_refusal(status.error))
        if status.nbytes != dst.nbytes:
            raise _Refused(
                InvalidRequest(f"chunk of {status.nbytes} bytes for a region of {dst.nbytes}")
            )
        verify = self.policy.verify and status.checksummed and isinstance(dst, np.ndarray)
        if verify and xxhash.xxh3_64_intdigest(dst) != status.checksum:
            raise ChecksumMismatch(f"layer {layer} kv {kv}: checksum mismatch")
        return dst.nbytes

    async def _keep_lease(self, handle: KvHandle) -> None:
        """Renew the handle's lease while the pull runs, well before it lapses."""
        stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(handle.control_address))
        access = kvtransfer_pb2.KvAccess(
            handle_id=handle.handle_id, access_token=handle.access_token
        )
        expiry_ms = handle.lease_expiry_unix_ms
        while True:
            remaining = expiry_ms / 1000 - time.time()
            await asyncio.sleep(max(0.05, remaining / 3))
            try:
                renewed = await stub.RenewLease(
                    kvtransfer_pb2.RenewLeaseRequest(access=access), timeout=5
                )
            except grpc.aio.AioRpcError as e:
                log.warning("lease renewal of %s failed: %s", handle.handle_id, e.code().name)
                continue
            expiry_ms = renewed.lease_expiry_unix_ms
            self.lease_renewals += 1

    async def pull_staged(self, handle: KvHandle) -> np.ndarray:
        """The handle's KV as it lies at the source, (layers, 2, blocks * block_bytes) bytes,
        for a caller whose own layout differs (block size, dtype) and converts it."""
        n = handle.num_blocks
        staging = np.empty((handle.num_layers, 2, n * handle.block_bytes), dtype=np.uint8)
        bb = handle.block_bytes

        def region(layer: int, kv: int, first: int, count: int) -> np.ndarray:
            return staging[layer, kv, first * bb : (first + count) * bb]

        await self.pull(handle, list(range(n)), region)
        return staging

    async def release(self, handle: KvHandle) -> int:
        """Tell the source to free the handle's KV; returns the blocks it freed."""
        stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(handle.control_address))
        access = kvtransfer_pb2.KvAccess(
            handle_id=handle.handle_id, access_token=handle.access_token
        )
        reply = await stub.Release(access, timeout=10)
        return reply.blocks_freed

    async def close(self) -> None:
        for ep in self._endpoints.values():
            with contextlib.suppress(Exception):
                await ep.close()
        self._endpoints.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    async def _endpoint(self, host: str, port: int):
        """The cached endpoint to a peer, connecting (again) when there is none or it closed:
        a peer that restarted gets a fresh endpoint, never stale state."""
        key = (host, port)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(key)
            if ep is None or ep.closed:
                try:
                    ep = await ucxx.create_endpoint(host, port)
                except Exception as e:
                    raise Unavailable(f"cannot reach the KV source at {host}:{port}: {e}") from e
                if key in self._connected:
                    self.reconnects += 1
                self._connected.add(key)
                self._endpoints[key] = ep
            return ep

    def _drop(self, host: str, port: int, ep) -> None:
        """Forget a broken endpoint (only if it is still the cached one) and abort it."""
        if self._endpoints.get((host, port)) is ep:
            del self._endpoints[(host, port)]
        with contextlib.suppress(Exception):
            ep.abort()


def _refusal(error: str) -> DistServeError:
    if "wrong access token" in error:
        return PermissionDenied(error)
    if "does not exist" in error:
        return NotFound(error)
    return InvalidRequest(error)
