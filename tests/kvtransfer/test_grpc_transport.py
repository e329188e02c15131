"""The gRPC fallback transport fills any destination a pull may have: a numpy view of host
memory, or a uint8 tensor (what `memory.raw` gives for device memory; a CPU tensor stands in for
it here), and checksums the chunk as it came, so a device destination is verified too."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import torch

from services.common.gen.distserve.v1 import kvtransfer_pb2_grpc
from services.common.kv_handle import RankSource
from services.kvtransfer import wire
from services.kvtransfer.checksums import checksum
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.transports import GrpcTransport, Window
from tests.kvtransfer.test_ucx_pull import serve


def test_grpc_fills_host_and_tensor_destinations_and_checksums_what_came():
    async def scenario():
        cache = torch.arange(2 * 2 * 4 * 4 * 2 * 3, dtype=torch.float32).reshape(2, 2, 4, 4, 2, 3)
        server, handle = serve(cache, range(2), [(0, 2)])
        servicer = KvTransferServicer(server.source.leases, free=None, source=server.source)
        rpc = grpc.aio.server()
        kvtransfer_pb2_grpc.add_KvTransferServicer_to_server(servicer, rpc)
        port = rpc.add_insecure_port("127.0.0.1:0")
        await rpc.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        transport = GrpcTransport(lambda address: channel)
        source = RankSource(0, "127.0.0.1", server.port, range(2))
        request = wire.ChunkRequest(
            handle_id=handle.handle_id,
            access_token=handle.access_token,
            layer=1,
            kv=1,
            first_block=0,
            num_blocks=2,
        )
        expected = cache[1, 1, 0:2].reshape(-1).view(torch.uint8).numpy()
        try:
            for dst in (
                np.zeros(expected.nbytes, dtype=np.uint8),
                torch.zeros(expected.nbytes, dtype=torch.uint8),
            ):
                fetched = await transport.fetch(
                    handle, source, request, [dst], Window(1), 5.0, checksums=True
                )
                assert fetched.status.ok and fetched.status.checksummed
                got = dst if isinstance(dst, np.ndarray) else dst.numpy()
                assert np.array_equal(got, expected)
                assert fetched.digests == [await checksum(expected)]
                assert fetched.digests[0] == fetched.status.crc32c[0]
        finally:
            await channel.close()
            await rpc.stop(None)
            server.close()

    asyncio.run(scenario())
