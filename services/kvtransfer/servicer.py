"""The KvTransfer gRPC service: the control plane (describe, release, renew held KV) and the
data plane's fallback transport (FetchChunk)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import numpy as np

from services.common import clock, telemetry
from services.common.errors import DistServeError, FailedPrecondition, InvalidRequest
from services.common.gen.distserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.kvtransfer import faults
from services.kvtransfer.leases import Lease, LeaseTable
from services.kvtransfer.refusals import refused
from services.kvtransfer.source import SEND_TIMEOUT_S, ChunkSource


class KvTransferServicer(kvtransfer_pb2_grpc.KvTransferServicer):
    """Held KV of a prefill instance; `free` returns a lease's blocks to its pool."""

    def __init__(
        self, leases: LeaseTable, free: Callable[[Lease], Awaitable[int]], source: ChunkSource
    ) -> None:
        self.leases = leases
        self.free = free
        self.source = source

    async def Describe(self, request, context):
        return self.leases.get(request.handle_id, request.access_token).handle.to_pb()

    async def AwaitFirstToken(self, request, context):
        lease = self.leases.get(request.handle_id, request.access_token)
        if lease.first_token is None:
            raise FailedPrecondition("the handle is not layer-wise: its first token came with it")
        token, done_unix_s = await asyncio.shield(lease.first_token)
        return kvtransfer_pb2.FirstToken(token_id=token, prefill_done_unix_s=done_unix_s)

    async def Release(self, request, context):
        """Free held KV. The caller's trace context (the pull's span) gets the source's side of
        the release as a span: how long freeing took once the last sends stopped."""
        start = clock.monotonic()
        lease = self.leases.pop(request.handle_id, request.access_token)
        freed = await self.free(lease)
        telemetry.record(
            "kv.release",
            telemetry.incoming(context),
            start,
            clock.monotonic(),
            {"kv.blocks": freed},
        )
        return kvtransfer_pb2.ReleaseResponse(blocks_freed=freed)

    async def RenewLease(self, request, context):
        access = request.access
        return self.leases.renew(access.handle_id, access.access_token, request.extend_ms).to_pb()

    async def FetchChunk(self, request, context):
        try:
            if len(request.chunks) > 1:
                raise InvalidRequest("FetchChunk answers one chunk a call")
            chunks = await self.source.open_when_ready(request)
            (chunk,) = chunks
            await self.source.ready(chunk)
        except DistServeError as e:
            # A refusal is an answer, as on the UCX path: the puller maps it to its error.
            return kvtransfer_pb2.KvChunkReply(status=refused(e))
        with self.source.sending(chunks):
            # The reply carries a copy of the bytes in host memory: a chunk in device memory is
            # copied first, so that it is checksummed as any other (over UCX it moves device to
            # device, with no host copy to hash, and goes unchecksummed).
            if not isinstance(chunk.data, np.ndarray):
                chunk.data = chunk.data.cpu().numpy()
            await self.source.seal(chunk)
            data = chunk.data
            if chunk.fault is not None:

                async def close() -> None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "closed (fault injection)")

                async def drop() -> None:
                    await asyncio.sleep(SEND_TIMEOUT_S)  # never answers in the puller's time
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "dropped (fault injection)")

                data = await faults.strike(chunk.fault, data, close=close, drop=drop)
            reply = kvtransfer_pb2.KvChunkReply(
                status=self.source.status(chunks), data=data.tobytes()
            )
            self.source.served(chunk)
            return reply
