"""Runs an engine on its own thread for a gRPC service on asyncio.

All engine calls happen on the engine thread. The event loop sends commands (`call`: one of the
closed vocabulary in services.engine.commands, never a closure), which run between steps; each
step's outputs come back once per step (one `call_soon_threadsafe`) and are
routed to the queue of each request. Torch releases the GIL in its kernels, so the event loop
stays responsive while a step runs.

With a tensor-parallel group (`group`), every command and every step is first sent to the other
ranks, which apply the same ones in the same order (SPMD); with tp == 1 nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common import clock
from services.common.errors import InvalidRequest
from services.engine.commands import AdmitPulls, EngineCommand, PrefillStep, Step
from services.engine.engine import LLMEngine
from services.engine.sequence import Sequence, StepOutput
from services.worker.prefix_log import PrefixCacheLog

if TYPE_CHECKING:
    from services.worker.tp_group import RankGroup

log = logging.getLogger("distserve.engine")

STEP_MS_WEIGHT = 0.2  # of the newest decode step in EngineLoad.decode_step_ms


@dataclass(frozen=True)
class StepInfo:
    """One engine step: what kind, how big, when it started (`clock.monotonic()` s) and how long
    it took (s of the mesh's clock)."""

    kind: str  # "prefill" or "decode"
    batch_size: int
    batch_tokens: int
    started: float
    seconds: float


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's queues, taken by the engine thread after each iteration."""

    queued_prompt_tokens: int = 0
    waiting_seqs: int = 0
    running_seqs: int = 0
    pending_pulls: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    requests: int = 0
    decode_step_ms: float = 0.0  # recent decode steps' time (an exponential average)


class EngineFailed(Exception):
    """Delivered to every request in flight when a step raised."""


class EngineLoop:
    """The engine's thread. `hold=True` is a prefill instance (prefill only, KV held)."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        hold: bool = False,
        on_admitted: Callable[[list[Sequence]], None] | None = None,
        on_scheduled: Callable[[list[tuple[str, tuple]]], None] | None = None,
        on_layer: Callable[[list[str], int], None] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
        group: RankGroup | None = None,
    ) -> None:
        """on_admitted(seqs): pulled requests got their blocks (decode). For a prefill
        instance, on the event loop, for the requests in `layerwise` only (those whose KV is
        published as it is computed): on_scheduled([(request id, block runs)]) when a batch has
        its blocks, before it runs; on_layer(request ids, i) once its layer i is computed. A
        batch with none of them runs without the calls (each would wake the event loop).
        on_step(info): after each step that produced output, on the event loop (metrics).
        `group`: the other ranks of a tensor-parallel engine (None: tp == 1).

        `prefix_log`: what the engine's prefix cache stored and evicted, taken from it on this
        thread after each step, for the worker's load feed (None: the cache is off)."""
        self.engine = engine
        self.prefix_log = PrefixCacheLog(engine.cache_salt) if engine.prefix.enabled else None
        self.group = group
        self.hold = hold
        self._on_admitted = on_admitted
        self._on_scheduled = on_scheduled
        self._on_layer = on_layer
        self._on_step = on_step
        self.layerwise: set[str] = set()  # add a request id before submitting the request
        self._batch: list[str] = []  # the running batch's layer-wise requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._step_ms = 0.0
        self.load = EngineLoad(
            total_blocks=engine.pool.num_blocks, free_blocks=engine.pool.num_free
        )

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def call(self, command: EngineCommand) -> Any:
        """Run a command on the engine thread between steps; its result or exception."""
        future = self._loop.create_future()
        self._commands.put((command, future))
        self._wake.set()
        return await future

    def submit(self, request_id: str, command: EngineCommand) -> None:
        """Run a command on the engine thread without waiting; if it raises, the exception is
        delivered to the request's queue (so adding a request costs no round trip)."""
        self._commands.put((command, request_id))
        self._wake.set()

    def subscribe(self, request_id: str) -> asyncio.Queue:
        """Queue of (StepOutput, StepInfo) for a request; subscribe before adding it. An
        exception in place of a StepOutput ends the request (EngineFailed, or what a submitted
        command raised)."""
        if request_id in self._queues:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def subscribed(self) -> int:
        """Requests with a queue: those a caller is still waiting on."""
        return len(self._queues)

    def fail_subscribed(self, error: Exception) -> None:
        """End every subscribed request with `error` (e.g. a drain that ran out of time)."""
        for q in self._queues.values():
            q.put_nowait((error, None))

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            # Before the step too: while a prefill batch runs, its prompts still count as
            # queued (taken out of the waiting queue, they would vanish from the load).
            self._snapshot()
            try:
                self._iterate()
            except Exception as e:  # a bug or a device error: fail what is in flight, go on
                log.exception("engine step failed")
                self._loop.call_soon_threadsafe(self._fail_all, e)
            self._snapshot()
            if self._commands.empty() and not self._busy():
                self.engine.idle()
                self._wake.wait(timeout=0.1)

    def _busy(self) -> bool:
        e = self.engine
        return bool(e.waiting) if self.hold else e.has_unfinished()

    def _iterate(self) -> None:
        engine = self.engine
        if engine.pull_waiting and self._on_admitted is not None:
            admitted = self._apply(AdmitPulls())
            if admitted:
                self._loop.call_soon_threadsafe(self._on_admitted, admitted)
        if not self._busy():
            return
        started = clock.monotonic()
        if self.hold:
            if self.group is not None:
                self.group.broadcast(PrefillStep())
            layerwise = bool(self.layerwise)
            outputs = engine.prefill_step(
                hold=True,
                on_scheduled=self._scheduled if layerwise and self._on_scheduled else None,
                on_layer=self._layer if layerwise and self._on_layer else None,
            )
        else:
            outputs = self._apply(Step())
        if not outputs:
            return
        kind, size, tokens = engine.last_step
        info = StepInfo(kind, size, tokens, started, clock.monotonic() - started)
        if kind == "decode":
            self._step_ms += STEP_MS_WEIGHT * (info.seconds * 1000 - self._step_ms)
        self._loop.call_soon_threadsafe(self._dispatch, outputs, info)

    def _scheduled(self, seqs: list[Sequence]) -> None:
        seqs = [s for s in seqs if s.request_id in self.layerwise]
        self._batch = [s.request_id for s in seqs]
        if seqs:
            runs = [(s.request_id, tuple((f, n) for f, n in s.block_table.runs)) for s in seqs]
            self._loop.call_soon_threadsafe(self._on_scheduled, runs)

    def _layer(self, layer: int) -> None:
        if self._batch:
            self._loop.call_soon_threadsafe(self._on_layer, self._batch, layer)

    def _run_commands(self) -> None:
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result: Any = self._apply(command)
            except Exception as e:
                if isinstance(future, str):  # submitted for a request: fail that request
                    self._loop.call_soon_threadsafe(self._fail, future, e)
                else:
                    self._loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                if not isinstance(future, str):
                    self._loop.call_soon_threadsafe(_settle, future, result, None)

    def _apply(self, command: EngineCommand) -> Any:
        """Apply a command here, after sending it to the group's other ranks."""
        if self.group is not None:
            self.group.broadcast(command)
        return command.apply(self.engine)

    def _snapshot(self) -> None:
        e = self.engine
        if self.prefix_log is not None:
            events = e.kv_events()
            if events.reset or events.stored or events.removed:
                self.prefix_log.record(events.reset, events.stored, events.removed)
        self.load = EngineLoad(
            queued_prompt_tokens=sum(s.num_tokens for s in e.waiting),
            waiting_seqs=len(e.waiting),
            running_seqs=len(e.running),
            pending_pulls=len(e.pull_waiting),
            free_blocks=e.pool.num_free,
            total_blocks=e.pool.num_blocks,
            requests=e.num_requests,
            decode_step_ms=self._step_ms,
        )

    # -- on the event loop -----------------------------------------------------------------------

    def _dispatch(self, outputs: list[StepOutput], info: StepInfo) -> None:
        if self._on_step is not None:
            self._on_step(info)
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait((out, info))

    def _fail(self, request_id: str, error: Exception) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait((error, None))

    def _fail_all(self, error: Exception) -> None:
        for q in self._queues.values():
            q.put_nowait((EngineFailed(str(error)), None))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
