"""The KvTransfer control service: describe, release and renew held KV."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from services.common.gen.distserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.kvtransfer.leases import Lease, LeaseTable


class KvTransferServicer(kvtransfer_pb2_grpc.KvTransferServicer):
    """Control plane of a prefill instance's held KV; `free` returns a lease's blocks."""

    def __init__(self, leases: LeaseTable, free: Callable[[Lease], Awaitable[int]]) -> None:
        self.leases = leases
        self.free = free

    async def Describe(self, request, context):
        return self.leases.get(request.handle_id, request.access_token).handle.to_pb()

    async def Release(self, request, context):
        lease = self.leases.pop(request.handle_id, request.access_token)
        return kvtransfer_pb2.ReleaseResponse(blocks_freed=await self.free(lease))

    async def RenewLease(self, request, context):
        access = request.access
        return self.leases.renew(access.handle_id, access.access_token, request.extend_ms).to_pb()
