"""The data plane over UCX, server side.

A puller sends a KvChunkRequest frame (handle, token, layer, K or V, up to MAX_CHUNKS ranges of
the handle's blocks, a reply tag t); the server sends each chunk's bytes on tag 2*(t + i) + 1,
from the KV cache in place and all at once (UCX moves each as the puller posts its receive: the
puller's window decides how many move at a time), checksums them (CRC-32C) meanwhile, and when
every chunk is out sends one KvChunkStatus frame on tag 2*t with the checksums, which the puller
verifies. A refused request gets its status and a one-byte filler on each data tag: the filler
completes the receive the puller posted in advance. One request of many chunks, not a request,
a status and the data per chunk: every UCX message has a fixed cost (~0.13 ms one way on 2
cores, `bench/experiments/ucx_modes.py`). Tags are the connection's own
(services/kvtransfer/ucx_loop.py).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from services.common.errors import DistServeError, NotFound
from services.kvtransfer import faults, ucx_loop, wire
from services.kvtransfer.refusals import refused
from services.kvtransfer.source import SEND_TIMEOUT_S, ChunkSource, ranges

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
        self.requests_served = 0  # answered with every chunk's data and a status

    def start(self, port: int = 0, host: str = "") -> int:
        """Listen on `host`:`port` (port 0: any free one; host "": every address), from the
        running event loop; returns the port."""
        self._listener = ucx_loop.worker().listen(self._serve_endpoint, port, host)
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
                task = asyncio.create_task(self._serve_request(ep, req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except Exception as e:  # the puller closed its endpoint or went away
            log.debug("endpoint closed: %s", e)
        finally:
            for task in tasks:
                task.cancel()
            ep.abort()

    async def _serve_request(self, ep, req) -> None:
        status_tag = 2 * req.tag
        data_tags = [2 * (req.tag + i) + 1 for i in range(len(ranges(req)))]
        try:
            chunks = await self.source.open_when_ready(req)
        except DistServeError as e:
            await _refuse(ep, e, status_tag, data_tags)
            return
        sends: dict[int, asyncio.Future] = {}  # data tag -> the chunk's send
        with self.source.sending(chunks):
            answering = False  # the status frame is on its way: the answer is given
            try:
                try:
                    await self._send_all(ep, chunks, data_tags, sends)
                except DistServeError as e:  # a layer never computed
                    await _refuse(ep, e, status_tag, _unsent(data_tags, sends))
                    return
                answering = True
                # Bounded: a puller that vanished must not pin the lease's blocks forever.
                status = wire.encode(self.source.status(chunks))
                await asyncio.wait_for(ep.send(status, status_tag), SEND_TIMEOUT_S)
                self.requests_served += not _unsent(data_tags, sends)
            except asyncio.CancelledError:
                # The lease ended (released, lapsed, drained) before the answer went out: say
                # so now, rather than leave the puller waiting out its chunk timeout (with the
                # blocks of a cancelled request held on its side meanwhile). Not once the status
                # is on its way: a cancelled UCX send may still arrive, and a second status
                # would then land in a receive of another request's. Data tags already sent get
                # no filler; one whose send was cut off gets one, and whichever of the two
                # arrives first completes the puller's receive (tags are never reused).
                if not answering:
                    error = NotFound(
                        f"KV handle {req.handle_id} does not exist: it ended meanwhile"
                    )
                    unsent = _unsent(data_tags, sends)
                    await _refuse(ep, error, status_tag, unsent, REFUSAL_TIMEOUT_S)
                raise
            except Exception as e:
                log.debug("chunk send failed: %s", e)
        unsent = _unsent(data_tags, sends)
        for chunk, tag in zip(chunks, data_tags, strict=True):
            if tag not in unsent:
                self.source.served(chunk)

    async def _send_all(self, ep, chunks, tags: list[int], sends: dict) -> None:
        """Each chunk's bytes from the KV cache in place, once its layer is computed (a
        request's chunks are in layer order: a layer-wise handle's go out as prefill computes
        them), checksummed while they go out; returns once every send completed. No task per
        chunk: a chunk's fixed cost is most of a small chunk's."""
        faulty = []
        for chunk, tag in zip(chunks, tags, strict=True):
            if chunk.fault is not None:
                faulty.append(asyncio.ensure_future(self._send_faulty(ep, chunk, tag, sends)))
                continue
            await self.source.ready(chunk)  # at once when the layer is computed
            sends[tag] = ep.send(chunk.data, tag)
        try:
            for chunk in chunks:
                if chunk.fault is None:
                    await self.source.seal(chunk)  # from its blocks' CRCs, taken at publication
            posted = list(sends.values())
            if posted:
                await asyncio.wait(posted, timeout=SEND_TIMEOUT_S)
            for send in posted:
                if not send.done():
                    raise TimeoutError(f"a chunk's receiver did not take it in {SEND_TIMEOUT_S} s")
                send.result()  # raises when the connection broke
            await asyncio.gather(*faulty)
        finally:
            for task in faulty:
                task.cancel()

    async def _send_faulty(self, ep, chunk, tag: int, sends: dict) -> None:
        """A chunk hit by an injected fault (tests and drills only). A dropped chunk is never
        sent: the puller's receive for it times out."""
        await self.source.ready(chunk)
        await self.source.seal(chunk)
        data = await faults.strike(chunk.fault, chunk.data, close=ep.close, drop=_never_sent)
        if data is None:
            return
        sends[tag] = ep.send(data, tag)
        await asyncio.wait_for(sends[tag], SEND_TIMEOUT_S)


async def _never_sent() -> None:
    pass


def _unsent(tags: list[int], sends: dict) -> list[int]:
    """The data tags whose send did not complete (never posted, cut off, or failed)."""
    return [
        tag
        for tag in tags
        if not (
            (send := sends.get(tag)) is not None
            and send.done()
            and not send.cancelled()
            and send.exception() is None
        )
    ]


async def _refuse(
    ep,
    error: DistServeError,
    status_tag: int,
    data_tags: list[int],
    timeout_s: float | None = None,
) -> None:
    """A refusal: its status, then a filler that completes each posted data receive."""
    refusal = wire.encode(refused(error))
    try:
        await asyncio.wait_for(ep.send(refusal, status_tag), timeout_s)
        for tag in data_tags:
            await asyncio.wait_for(ep.send(_FILLER, tag), timeout_s)
    except Exception as e:
        log.warning("refusal send failed: %s", e)
