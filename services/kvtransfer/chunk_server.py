"""The data plane's server side: serves chunks of held KV over UCX.

A puller sends a KvChunkRequest frame (handle, token, layer, K or V, a range of the handle's
blocks, a reply tag); the server answers with a KvChunkStatus frame on tag 2*t and then, on tag
2*t + 1, the raw bytes of that contiguous region, sent from the KV cache in place (a one-byte
filler when the request is refused: it completes the receive the puller posted in advance).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np
import ucxx

from services.common.errors import DistServeError, InvalidRequest
from services.kvtransfer import wire
from services.kvtransfer.leases import LeaseTable

log = logging.getLogger("distserve.kvtransfer")

# region(layer, kv, first_block_id, num_blocks) -> a buffer over those blocks' bytes
RegionFn = Callable[[int, int, int, int], object]


class ChunkServer:
    """UCX listener that serves chunks of KV to holders of a valid handle."""

    def __init__(self, leases: LeaseTable, region: RegionFn, num_layers: int) -> None:
        self.leases = leases
        self.region = region
        self.num_layers = num_layers
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
        lease.begin_send()
        try:
            data = self.region(req.layer, req.kv, first, req.num_blocks)
            await ep.send(
                wire.encode(wire.ChunkStatus(ok=True, nbytes=data.nbytes)), tag=status_tag
            )
            await ep.send(data, tag=data_tag)
            self.chunks_served += 1
            self.bytes_served += data.nbytes
        except Exception as e:
            log.debug("chunk send failed: %s", e)
        finally:
            lease.end_send()

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
