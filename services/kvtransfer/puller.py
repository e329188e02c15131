"""The data plane's client side: pulls a handle's KV into local blocks over UCX.

The handle's blocks and the destination blocks are paired in order; each chunk is one layer's K
or V for a range that is consecutive on both sides (at most `chunk_bytes`), received straight
into the destination region. Up to `window` chunks are in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

import grpc
import numpy as np
import ucxx

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


class KvPuller:
    """Pulls KV from prefill instances; keeps one UCX endpoint and gRPC channel per peer."""

    def __init__(
        self, chunk_bytes: int = 4 * 2**20, window: int = 4, chunk_timeout_s: float = 10.0
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.chunk_timeout_s = chunk_timeout_s
        self._endpoints: dict[tuple[str, int], object] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tags = itertools.count(1)

    async def pull(self, handle: KvHandle, dst_blocks: list[int], dst_region: RegionFn) -> int:
        """Fill dst_blocks with the handle's KV; returns the bytes received.

        Raises Unavailable when the source cannot be reached or fails, PermissionDenied or
        NotFound when it refuses the handle. The destination then holds partial KV: the caller
        must not decode from it.
        """
        src_blocks = handle.blocks()
        if len(src_blocks) != len(dst_blocks):
            raise InvalidRequest(
                f"handle has {len(src_blocks)} blocks, destination {len(dst_blocks)}"
            )
        ep = await self._endpoint(handle.ucx_host, handle.ucx_port)
        per_chunk = max(1, self.chunk_bytes // max(1, handle.block_bytes))
        segs = segments(src_blocks, dst_blocks, per_chunk)
        jobs = [
            (layer, kv, seg) for layer in range(handle.num_layers) for kv in (0, 1) for seg in segs
        ]
        gate = asyncio.Semaphore(self.window)

        async def one(layer: int, kv: int, seg: tuple[int, int, int]) -> int:
            async with gate:
                try:
                    return await asyncio.wait_for(
                        self._chunk(ep, handle, layer, kv, seg, dst_region), self.chunk_timeout_s
                    )
                except TimeoutError as e:
                    raise Unavailable(
                        f"KV chunk (layer {layer}) from {handle.source_instance} took longer "
                        f"than {self.chunk_timeout_s} s"
                    ) from e

        tasks = [asyncio.ensure_future(one(*job)) for job in jobs]
        try:
            sizes = await asyncio.gather(*tasks)
        except DistServeError as e:
            if isinstance(e, Unavailable):  # a transport fault: reconnect next time
                self._drop(handle.ucx_host, handle.ucx_port)
            raise
        except Exception as e:
            self._drop(handle.ucx_host, handle.ucx_port)
            raise Unavailable(
                f"KV pull from {handle.source_instance} ({handle.ucx_host}:{handle.ucx_port}) "
                f"failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            for t in tasks:  # on failure, stop the other chunks: nothing writes after we return
                t.cancel()
        return sum(sizes)

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
        # refusal comes with an empty data message, which completes the data receive.
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
            raise _refusal(status.error)
        if status.nbytes != dst.nbytes:
            raise Unavailable(f"chunk of {status.nbytes} bytes for a region of {dst.nbytes}")
        return dst.nbytes

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
        key = (host, port)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(key)
            if ep is None or ep.closed:
                try:
                    ep = await ucxx.create_endpoint(host, port)
                except Exception as e:
                    raise Unavailable(f"cannot reach the KV source at {host}:{port}: {e}") from e
                self._endpoints[key] = ep
            return ep

    def _drop(self, host: str, port: int) -> None:
        ep = self._endpoints.pop((host, port), None)
        if ep is not None:
            with contextlib.suppress(Exception):
                ep.abort()


def _refusal(error: str) -> DistServeError:
    if "wrong access token" in error:
        return PermissionDenied(error)
    if "does not exist" in error:
        return NotFound(error)
    return Unavailable(error)
