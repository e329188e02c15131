"""The data plane's server side: serves chunks of held KV over UCX.

A puller sends a KvChunkRequest frame (handle, token, layer, K or V, a range of the handle's
blocks, a reply tag); the server answers with a KvChunkStatus frame on tag 2*t and then, on tag
2*t + 1, the raw bytes of that contiguous region, sent from the KV cache in place (a one-byte
filler when the request is refused: it completes the receive the puller posted in advance). The
status carries the xxh3-64 checksum of the data, which the puller verifies.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import numpy as np
import ucxx
import xxhash

from services.common.errors import DistServeError, InvalidRequest
from services.kvtransfer import wire
from services.kvtransfer.faults import Fault, FaultInjector
from services.kvtransfer.leases import LeaseTable

log = logging.getLogger("distserve.kvtransfer")

SEND_TIMEOUT_S = 30.0  # longest one chunk send may wait for its receiver

# region(layer, kv, first_block_id, num_blocks) -> a buffer over those blocks' bytes
RegionFn = Callable[[int, int, int, int], object]


class ChunkServer:
    """UCX listener that serves chunks of KV to holders of a valid handle."""

    def __init__(
        self,
        leases: LeaseTable,
        region: RegionFn,
        num_layers: int,
        faults: FaultInjector | None = None,
    ) -> None:
        self.leases = leases
        self.region = region
        self.num_layers = num_layers
        self.faults = faults  # tests and drills only
        self._listener = None
        self._endpoints: set[asyncio.Task] = set()
        self.port = 0
        self.chunks_served = 0
        self.bytes_served = 0

    def start(self, port: int = 0) -> int:
        self._listener = ucxx.create_listener(self._serve_endpoint, port=port)
        self.port = self._listener.port
        return self.port

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve_endpoint(self, ep) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                frame = wire.empty_frame()
                await ep.recv(frame)
                try:
                    req = wire.decode(frame, wire.ChunkRequest)
                except Exception:
                    log.warning("dropped a malformed chunk request frame")
                    continue
                task = asyncio.create_task(self._serve_chunk(ep, req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except Exception as e:  # the puller closed its endpoint or went away
            log.debug("endpoint closed: %s", e)
        finally:
            for task in tasks:
                task.cancel()

    async def _serve_chunk(self, ep, req) -> None:
        status_tag, data_tag = 2 * req.tag, 2 * req.tag + 1
        try:
            lease = self.leases.get(req.handle_id, req.access_token)
            first = self._check(req, lease.blocks)
        except DistServeError as e:
            refusal = wire.encode(wire.ChunkStatus(ok=False, error=str(e)))
            await _send_quietly(ep, refusal, status_tag)
            await _send_quietly(ep, _FILLER, data_tag)  # completes the puller's posted receive
            return
        fault = self.faults.next_chunk() if self.faults is not None else None
        me = asyncio.current_task()
        lease.begin_send(me)
        try:
            data = self.region(req.layer, req.kv, first, req.num_blocks)
            status = wire.ChunkStatus(ok=True, nbytes=data.nbytes)
            if isinstance(data, np.ndarray):
                status.checksum = xxhash.xxh3_64_intdigest(data)
                status.checksummed = True
            if fault is not None:
                data = await self._inject(fault, ep, data)
                if data is None:
                    return
            # Bounded: a puller that vanished must not pin the lease's blocks forever.
            await asyncio.wait_for(ep.send(wire.encode(status), tag=status_tag), SEND_TIMEOUT_S)
            await asyncio.wait_for(ep.send(data, tag=data_tag), SEND_TIMEOUT_S)
            self.chunks_served += 1
            self.bytes_served += data.nbytes
        except Exception as e:
            log.debug("chunk send failed: %s", e)
        finally:
            lease.end_send(me)

    async def _inject(self, fault: Fault, ep, data):
        """Apply a configured fault; returns the data to send, or None to send nothing."""
        log.warning("injecting fault %s on chunk %d", fault.kind, fault.at)
        if fault.kind == "exit":
            os._exit(17)  # a crashed source: no cleanup, no goodbye
        if fault.kind == "drop":
            return None
        if fault.kind == "close":
            await ep.close()
            return None
        if fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
            return data
        corrupted = np.array(data, copy=True)
        corrupted[len(corrupted) // 2] ^= 0xFF
        return corrupted

    def _check(self, req, blocks: list[int]) -> int:
        """The first block id of the request's range, if the range is valid and contiguous."""
        if req.layer >= self.num_layers or req.kv > 1:
            raise InvalidRequest(f"no layer {req.layer} / kv {req.kv}")
        end = req.first_block + req.num_blocks
        if req.num_blocks == 0 or end > len(blocks):
            raise InvalidRequest(
                f"blocks {req.first_block}..{end} outside the handle's {len(blocks)}"
            )
        first = blocks[req.first_block]
        if blocks[req.first_block : end] != list(range(first, first + req.num_blocks)):
            raise InvalidRequest("a chunk must cover consecutive blocks")
        return first


# Sent in place of refused data (UCX does not send empty messages); the puller discards it.
_FILLER = np.zeros(1, dtype=np.uint8)


async def _send_quietly(ep, frame, tag: int) -> None:
    try:
        await ep.send(frame, tag=tag)
    except Exception as e:
        log.warning("status send failed: %s", e)
