"""The data plane over UCX, server side.

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

import numpy as np

from services.common.errors import DistServeError
from services.kvtransfer import wire
from services.kvtransfer.source import SEND_TIMEOUT_S, ChunkSource, corrupted
from services.kvtransfer.transports import HANDSHAKE_TIMEOUT_S

log = logging.getLogger("distserve.kvtransfer")

# Sent in place of refused data (UCX does not send empty messages); the puller discards it.
_FILLER = np.zeros(1, dtype=np.uint8)
REFUSAL_TIMEOUT_S = 1.0  # a refusal sent while the lease's blocks are being freed


class ChunkServer:
    """UCX listener that serves chunks of KV to holders of a valid handle."""

    def __init__(self, source: ChunkSource) -> None:
        self.source = source
        self._listener = None
        self.port = 0

    def start(self, port: int = 0) -> int:
        import ucxx  # only hosts that serve over UCX need it

        # The handshake of each connection runs to its end (see transports.HANDSHAKE_TIMEOUT_S).
        self._listener = ucxx.create_listener(
            self._serve_endpoint, port=port, connect_timeout=HANDSHAKE_TIMEOUT_S
        )
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
            chunk = await self.source.open_when_ready(req)
        except DistServeError as e:
            await _refuse(ep, str(e), status_tag, data_tag)
            return
        with self.source.sending(chunk):
            answering = False  # the status frame is on its way: the answer is given
            try:
                data = chunk.data
                fault = chunk.fault
                if fault is not None:
                    if fault.kind == "exit":
                        os._exit(17)  # a crashed source: no cleanup, no goodbye
                    if fault.kind == "drop":
                        return
                    if fault.kind == "close":
                        await ep.close()
                        return
                    if fault.kind == "delay":
                        await asyncio.sleep(fault.seconds)
                    if fault.kind == "corrupt":
                        data = corrupted(data)
                # Bounded: a puller that vanished must not pin the lease's blocks forever.
                await self.source.seal(chunk)
                status = wire.encode(chunk.status)
                answering = True
                await asyncio.wait_for(ep.send(status, tag=status_tag), SEND_TIMEOUT_S)
                await asyncio.wait_for(ep.send(data, tag=data_tag), SEND_TIMEOUT_S)
                self.source.served(chunk)
            except asyncio.CancelledError:
                # The lease ended (released, lapsed, drained) before this chunk went out: say
                # so now, rather than leave the puller waiting out its chunk timeout (with the
                # blocks of a cancelled request held on its side meanwhile). Not once the status
                # is on its way: a cancelled UCX send may still arrive, and a second status and
                # a filler would then land in the receives of this one (a chunk of wrong bytes,
                # which the puller's checksum rejects: 18 in a fault-free chaos run).
                if not answering:
                    error = f"KV handle {req.handle_id} does not exist: it ended meanwhile"
                    await _refuse(ep, error, status_tag, data_tag, REFUSAL_TIMEOUT_S)
                raise
            except Exception as e:
                log.debug("chunk send failed: %s", e)


async def _refuse(
    ep, error: str, status_tag: int, data_tag: int, timeout_s: float | None = None
) -> None:
    """A refusal: its status, then the filler that completes the puller's posted receive."""
    refusal = wire.encode(wire.ChunkStatus(ok=False, error=error))
    try:
        await asyncio.wait_for(ep.send(refusal, tag=status_tag), timeout_s)
        await asyncio.wait_for(ep.send(_FILLER, tag=data_tag), timeout_s)
    except Exception as e:
        log.warning("refusal send failed: %s", e)
