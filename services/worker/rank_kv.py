"""A follower rank's own KV data plane (tensor parallelism): RankKv, the engine's KvHooks
(services.engine.kv_hooks) built on the KV transfer library (services.kvtransfer).

Each rank of a tensor-parallel instance holds a range of the KV heads in its own cache. Rank 0
moves its heads on its event loop, as a single-rank instance does; a follower rank moves its own
here, on an asyncio loop thread of its own, so KV never passes through rank 0 or a collective:

- A prefill follower serves its heads on a UCX listener of its own (its port is in every handle's
  `rank_sources`). It learns of handles from rank 0 on its control pipe (one JSON line each,
  written as rank 0 creates them) and of computed layers from its own prefill (`scheduled`,
  `layer_done`). It ends no lease itself: a Release or Abort from rank 0 first closes the lease
  here and waits for its sends (`forget`), then frees the blocks. Rank 0 announces a handle
  before it sends any command that ends it, so `forget` first reads what the control pipe holds:
  an announcement never arrives after the end of its lease.
- A decode follower pulls the heads it owns (`pull`, from rank 0's PullKv command) into the
  blocks rank 0 allocated (the same ids on every rank) and tells rank 0 how it went on its
  events pipe; an Abort cancels the pull and waits for it to settle (`forget`) before the blocks
  are freed.

The methods without a leading `_` are called from the follower's engine thread; the others run on
the loop thread (which also reads the control pipe), whose state they alone touch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from dataclasses import asdict
from typing import BinaryIO

from services.common.errors import DistServeError
from services.common.kv_handle import KvHandle
from services.engine.engine import LLMEngine
from services.engine.parallel import TensorParallel
from services.engine.sequence import Sequence, StepOutput
from services.kvtransfer.chunk_server import ChunkServer
from services.kvtransfer.leases import Lease, LeaseTable
from services.kvtransfer.puller import KvPuller, PullPolicy
from services.kvtransfer.source import ADOPT_WAIT_S, SEND_TIMEOUT_S, ChunkSource
from services.kvtransfer.ucx_setup import shutdown_ucx

log = logging.getLogger("distserve.kvtransfer")

FORGET_TIMEOUT_S = SEND_TIMEOUT_S + 15.0  # a pull settles within its chunk timeout


class RankKv:
    """One follower rank's KV endpoints: `serve` (prefill) or pull (decode). Implements the
    engine's KvHooks: the engine commands call it on the follower's engine thread."""

    def __init__(
        self,
        engine: LLMEngine,
        tp: TensorParallel,
        events: BinaryIO,
        control_fd: int,
        *,
        serve: bool,
        policy: PullPolicy | None = None,
        transport: str = "auto",
        host: str = "",
        port: int = 0,
    ) -> None:
        self.engine = engine
        self.heads = engine.kv_geometry.heads_of(tp.rank, tp.world_size)
        self._events = events
        self._write_lock = threading.Lock()
        self._batch: list[str] = []  # the prefill batch running now (engine thread)
        self._layers: dict[str, int] = {}  # request id -> layers computed here
        self._control_fd = control_fd
        self._control = b""  # a partial line read from the control pipe
        self._pulls: dict[str, asyncio.Task] = {}
        self.leases: LeaseTable | None = None
        self.server: ChunkServer | None = None
        self.puller: KvPuller | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rank-kv", daemon=True)
        self._thread.start()
        self.port = self._call(self._start(serve, policy, transport, host, port), timeout=60)

    # -- from the engine thread ---------------------------------------------------------------

    def report(self, event: dict) -> None:
        """One JSON line to rank 0."""
        line = json.dumps(event).encode() + b"\n"
        with self._write_lock:
            self._events.write(line)
            self._events.flush()

    def scheduled(self, seqs: list[Sequence]) -> None:
        self._batch = [s.request_id for s in seqs]

    def layer_done(self, layer: int) -> None:
        self.loop.call_soon_threadsafe(self._publish, self._batch, layer + 1)

    def step_done(self, outputs: list[StepOutput]) -> None:
        """Prompts that ended at their first token have no KV left here."""
        for out in outputs:
            if out.finished:
                self.loop.call_soon_threadsafe(self._end, out.request_id)

    def pull(self, request_id: str, handle: str, blocks: list[int], skip: int = 0) -> None:
        """Start pulling this rank's heads of `handle` (`KvHandle.encode()`) into `blocks`, from
        its block `skip` on; the outcome goes to rank 0 as a `pulled` event."""
        decoded = KvHandle.decode(handle)
        self.loop.call_soon_threadsafe(self._start_pull, request_id, decoded, blocks, skip)

    def forget(self, request_id: str) -> None:
        """Before a request's blocks are freed: close its lease (and wait for its sends), or
        cancel its pull (and wait for it to settle)."""
        try:
            self._call(self._forget(request_id), timeout=FORGET_TIMEOUT_S)
        except TimeoutError:
            log.error(
                "request %s: its KV transfer did not stop within %s s", request_id, FORGET_TIMEOUT_S
            )

    def close(self) -> None:
        try:
            self._call(self._stop(), timeout=10)
        except Exception as e:
            log.warning("closing the rank's KV endpoints: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        shutdown_ucx()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- on the loop thread --------------------------------------------------------------------

    async def _start(
        self, serve: bool, policy: PullPolicy | None, transport: str, host: str, port: int
    ) -> int:
        os.set_blocking(self._control_fd, False)
        self.loop.add_reader(self._control_fd, self._read_control)
        if serve:
            self.leases = LeaseTable(default_s=3600.0, max_s=3600.0)
            source = ChunkSource(
                self.leases,
                self.engine.runner.cache.region,
                self.engine.kv_geometry.num_layers,
                self.heads,
                adopt_wait_s=ADOPT_WAIT_S,
                planes=self.engine.kv_geometry.planes,
            )
            self.server = ChunkServer(source)
            return self.server.start(port, host=host)
        self.puller = KvPuller(policy, transport)
        await self.puller.warm_up(host or "127.0.0.1")
        return 0

    async def _stop(self) -> None:
        for task in list(self._pulls.values()):
            task.cancel()
        await asyncio.gather(*self._pulls.values(), return_exceptions=True)
        if self.server is not None:
            self.server.close()
        if self.puller is not None:
            await self.puller.close()

    def _read_control(self) -> None:
        """Take in every handle announcement the control pipe holds now."""
        while True:
            try:
                data = os.read(self._control_fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:  # rank 0 closed it: the group is ending
                self.loop.remove_reader(self._control_fd)
                break
            self._control += data
        *lines, self._control = self._control.split(b"\n")
        for line in lines:
            message = json.loads(line)
            self._adopt(message["adopt"], KvHandle.decode(message["handle"]))

    def _adopt(self, request_id: str, handle: KvHandle) -> None:
        if self.leases is None:
            return
        layers = self._layers.get(request_id, 0) if handle.layerwise else handle.num_layers
        self.leases.adopt(request_id, handle, layers)

    def _publish(self, request_ids: list[str], layers: int) -> None:
        for request_id in request_ids:
            self._layers[request_id] = layers
            lease = self.leases.of_request(request_id) if self.leases is not None else None
            if lease is not None:
                lease.publish(layers)

    def _close(self, request_id: str) -> Lease | None:
        """Forget a request's lease (announced before now: the pipe is read first); the lease,
        if there was one."""
        self._read_control()
        self._layers.pop(request_id, None)
        return self.leases.pop_request(request_id) if self.leases is not None else None

    def _served(self, lease: Lease) -> None:
        self.report({"event": "served", "bytes": lease.bytes_sent})

    def _end(self, request_id: str) -> None:
        lease = self._close(request_id)
        if lease is not None:
            self._served(lease)

    async def _forget(self, request_id: str) -> None:
        lease = self._close(request_id)
        if lease is not None:
            await lease.stop_sends()
            self._served(lease)
        task = self._pulls.pop(request_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _start_pull(
        self, request_id: str, handle: KvHandle, blocks: list[int], skip: int = 0
    ) -> None:
        task = asyncio.ensure_future(self._pull(request_id, handle, blocks, skip))
        self._pulls[request_id] = task

        def done(_: asyncio.Task) -> None:
            if self._pulls.get(request_id) is task:
                del self._pulls[request_id]

        task.add_done_callback(done)

    async def _pull(
        self, request_id: str, handle: KvHandle, blocks: list[int], skip: int = 0
    ) -> None:
        event: dict = {"event": "pulled", "request_id": request_id}
        try:
            cache = self.engine.runner.cache
            report = await self.puller.pull_into(handle, cache, blocks, self.heads, skip=skip)
        except asyncio.CancelledError:
            raise  # rank 0 gave the request up: it waits for nothing
        except DistServeError as e:
            event.update(status=e.status, error=str(e))
        except Exception as e:
            event.update(status="UNAVAILABLE", error=f"{type(e).__name__}: {e}")
        else:
            event.update(report=asdict(report))
        self.report(event)
