"""UCX progressed on the event loop: the data plane's listeners, endpoints and messages.

ucxx's async layer offers two ways to wait for UCX, and both cost the data plane dearly
(`python bench/experiments/ucx_modes.py` measures both): in its `thread` mode a message's arrival
crosses three threads (UCX's progress thread, ucxx's notifier thread, the event loop), ~0.6 ms a
round trip of 1 KiB on 2 cores, and the progress thread wakes ~900 times a second even idle; in its
`blocking` mode each wait yields to the loop in a loop, so a process with a receive posted (a chunk
server always has one) spins a core. Here the loop progresses the worker when the worker's file
descriptor is readable, completes each request's future itself and re-arms the worker: one hop per
message (~0.2 ms a round trip), and an idle process sleeps. Built on ucxx's low-level API
(`ucxx._lib.libucxx`).

UCX matches tags across all of a worker's endpoints, so every connection has a namespace of
its own: the connecting side picks a 31-bit id, sends it over UCX's per-endpoint stream API and
waits for the listener to echo it (the handshake); a message's UCX tag is its tag (32 bits)
under the id, with the top bit set on messages to the listening side (so a worker's outgoing
and accepted connections never share a namespace, whatever ids their peers picked).

A buffer given to a request is referenced here until UCX completes the request (with its data
or an error), whatever happens to the waiter: a request is never cancelled, and a receive that
is given up on (a timeout, a cancelled task) cannot write into freed memory. To end the
requests of a connection, abort its endpoint: its requests in flight are cancelled (a receive
whose message never came would otherwise stay posted: UCX matches tags per worker) and UCX
completes them with an error.

A process may have more workers, *lanes* (`worker(lane=1)`, 2, ...), each progressed by a
thread of its own: UCX copies between processes of one host inside `progress` (CMA: the receiver
reads the sender's memory), so a puller that receives its chunks over two lanes copies on two
cores (measured here, the loop's worker and one lane: 64 MiB pulls in 8 MiB chunks, checksummed,
0.85x as long as on the loop alone, paired, `bench/experiments/kvtransfer_ab.py`; 256 MiB 0.83x;
two lanes against the loop's worker and one: 1 GiB 0.90x, 64 MiB 0.93x, the same bench). Every copy
into this process's memory is still made by this process, in `progress`: aborting an endpoint
(which waits for a progress call under way, UCX's workers being multi-threaded) ends them all.
Requests are made from the event loop as on the loop's worker; the lane thread progresses,
and settles their futures on the loop.

Why one file (~530 lines): UCX workers driven without ucxx's async layer, on the loop or a lane's
thread; a lane needs its base worker's internals, so a module of its own would import in a circle.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import secrets
import select
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import ClassVar

import numpy as np

from services.kvtransfer import ucx_bind

log = logging.getLogger("distserve.kvtransfer")

TAG_BITS = 32
TAG_MASK = (1 << TAG_BITS) - 1
ID_BITS = 31
TO_LISTENER = 1 << 63
ACCEPT_TIMEOUT_S = 30.0  # how long a listener waits for a new connection's handshake
# Longest stretch of progress before the loop runs its other callbacks. UCX copies KV between
# processes inside `progress` (512 KiB a call, UCX_CMA_SEG_SIZE): without a bound, a 64 MiB pull
# was copied whole inside one callback (13-20 ms without the loop), and no chunk's completion
# was seen, nor its checksum started, before the last chunk was copied. Against 0.5 ms, paired
# (`bench/experiments/kvtransfer_ab.py`): 1 ms 64 MiB -4.5%, 48 MiB in 512 KiB chunks -7%, 12 MiB
# and 256 MiB alike; 2 ms small pulls -5 to -7% but 64 MiB +5%.
PROGRESS_SLICE_S = 0.001

_workers: dict[tuple[asyncio.AbstractEventLoop, int], UcxWorker] = {}


def worker(lane: int = 0) -> UcxWorker:
    """The UCX worker of the running event loop (lane 0), or one of its lanes, each progressed
    by a thread of its own (created on first use; those of loops that have closed are closed
    then)."""
    loop = asyncio.get_running_loop()
    w = _workers.get((loop, lane))
    if w is None:
        for old in [key for key in _workers if key[0].is_closed()]:
            _workers.pop(old).close()
        w = _workers[loop, lane] = UcxLane(loop, lane) if lane else UcxWorker(loop)
    return w


def shutdown() -> None:
    """Close every worker's listeners and endpoints (a process about to exit)."""
    for w in list(_workers.values()):
        w.close()
    _workers.clear()


class UcxWorker:
    """One UCX worker, progressed by its event loop."""

    config: ClassVar[dict[str, str]] = {}  # UCX settings of its own, over the environment's

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self._api, self._array, self._tag, self._mask = ucx_api, Array, Tag, TagMaskFull
        self.loop = loop
        self.context = ucx_api.UCXContext(self.config)
        self.worker = ucx_api.UCXWorker(
            self.context, enable_delayed_submission=False, enable_python_future=False
        )
        self.worker.init_blocking_progress_mode()
        self._fd = self.worker.epoll_file_descriptor
        # request -> (its future, its buffer, what to make of the buffer once it completed)
        self._pending: dict[object, tuple[asyncio.Future, object, Callable | None]] = {}
        self._scheduled = False
        self._closed = False
        self._ids: dict[bool, set[int]] = {True: set(), False: set()}  # by listening side
        self._endpoints: weakref.WeakSet = weakref.WeakSet()
        self._listeners: weakref.WeakSet = weakref.WeakSet()
        # Held around each call into UCX made from the loop where another thread progresses
        # the worker (a lane): a call then sees the worker as it was after the last progress,
        # as on the loop's own worker.
        self.calls: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._start()

    def _start(self) -> None:
        self.loop.add_reader(self._fd, self.kick)

    # -- progress -------------------------------------------------------------------------------

    def kick(self) -> None:
        """Progress the worker soon (once, however many ask)."""
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._progress)

    def _progress(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        deadline = time.perf_counter() + PROGRESS_SLICE_S
        more = False
        # One `ucp_worker_progress` at a time: ucxx's `progress()` repeats it until nothing is
        # left (a slice could not cut it short), then does ucxx's upkeep (the requests of an
        # endpoint that failed are cancelled there), which runs once nothing is left.
        while self.worker.progress_once():
            if time.perf_counter() > deadline:
                more = True
                break
        else:
            self.worker.progress()
        for request, future, buffer, then in self._completed():
            _settle(request, future, _after(request, buffer, then))
        # Armed, the worker's descriptor wakes the loop on the next event; not armed (events
        # came in meanwhile) or cut short, progress again after the loop's other callbacks.
        if more or not self.worker.arm():
            self.kick()

    def _completed(self) -> list[tuple]:
        """(request, future, buffer, then) of each tracked request UCX has completed, no longer
        tracked (its buffer let go)."""
        if not self._pending:
            return []
        done = [r for r in self._pending if r.completed]
        return [(r, *self._pending.pop(r)) for r in done]

    def track(self, request, buffer, then: Callable | None = None) -> asyncio.Future:
        """A future of the request's completion, whose result is `then(buffer)` (None without
        `then`); `buffer` is kept until UCX completes the request."""
        future = self.loop.create_future()
        if request.completed:
            _settle(request, future, _after(request, buffer, then))
        else:
            self._pending[request] = (future, buffer, then)
            self.kick()
        return future

    def array(self, buffer):
        return self._array(buffer)

    def tag(self, value: int):
        return self._tag(value)

    # -- connections ----------------------------------------------------------------------------

    def listen(
        self, handler: Callable[[UcxEndpoint], Awaitable[None]], port: int = 0, host: str = ""
    ) -> UcxListener:
        """Accept connections on `host`:`port` (port 0: any free one; host "" or a wildcard:
        every address); each runs `handler(endpoint)` as a task once its handshake is done.
        Raises UcxBindError when UCX cannot listen on `host` alone."""
        bound = not ucx_bind.is_wildcard(host)
        listener = UcxListener(self, handler)
        listener.listener = self._api.UCXListener.create(
            worker=self.worker,
            port=0 if bound else port,
            cb_func=listener.accepted,
            cb_args=(),
            deliver_endpoint=True,
        )
        if bound:
            accept = functools.partial(listener.accepted_request, self._api.UCXEndpoint)
            try:
                listener.binding = ucx_bind.rebind(
                    listener.listener, self.worker.handle, host, port, accept
                )
            except ucx_bind.UcxBindError:
                listener.listener = None  # freed: its wildcard listener closes
                raise
        self._listeners.add(listener)
        self.kick()
        return listener

    async def connect(self, host: str, port: int) -> UcxEndpoint:
        """An endpoint to a listener, once its handshake is done. Raises ConnectionError when
        the peer cannot be reached or refuses; never returns before the handshake ended (its
        buffers stay referenced until UCX completes its requests)."""
        conn_id = self._new_conn_id()
        hello = np.array([conn_id], dtype="<u8")
        answer = np.zeros(1, dtype="<u8")
        try:
            with self.calls:  # on a lane: no progress in between, which could fail it first
                ep = self._api.UCXEndpoint.create(self.worker, host, port, True)
                try:
                    sending = ep.stream_send(self._array(hello))
                    receiving = ep.stream_recv(self._array(answer))
                except Exception:
                    _abort(ep)
                    raise
        except Exception as e:  # an address UCX cannot use
            self._ids[False].discard(conn_id)
            raise ConnectionError(f"UCX connection to {host}:{port} failed: {e}") from e
        endpoint = UcxEndpoint(self, ep, conn_id, listening=False)
        try:
            sent = self.track(sending, hello)
            got = self.track(receiving, answer)
            await sent
            await got
        except BaseException as e:
            endpoint.abort()
            if isinstance(e, Exception):
                raise ConnectionError(f"UCX connection to {host}:{port} failed: {e}") from e
            raise
        if int(answer[0]) != conn_id:
            endpoint.abort()
            raise ConnectionError(f"UCX connection to {host}:{port} refused")
        return endpoint

    def _new_conn_id(self) -> int:
        while True:
            conn_id = secrets.randbits(ID_BITS)
            if conn_id and conn_id not in self._ids[False]:
                self._ids[False].add(conn_id)
                return conn_id

    def close(self) -> None:
        """Stop listening and abort every endpoint (the loop may have stopped or closed)."""
        if self._closed:
            return
        self._closed = True
        for listener in list(self._listeners):
            listener.close()
        for endpoint in list(self._endpoints):
            endpoint.abort()
        self._stop()
        if not self.loop.is_closed():
            for future, *_ in self._pending.values():
                if not future.done():
                    _fail(future, ConnectionError("UCX worker closed"))
        self._pending.clear()

    def _stop(self) -> None:
        if not self.loop.is_closed():
            self.loop.remove_reader(self._fd)


class UcxLane(UcxWorker):
    """A UCX worker progressed by a thread of its own, which waits on the worker's descriptor
    (and on a pipe the loop writes to when it has made a request) and settles the completed
    requests' futures on the loop. Requests and connections are made from the loop, as on the
    loop's worker; a lane does not listen."""

    # A progress call copies up to a segment; between two, the thread takes the GIL back (from
    # the loop, or another lane). 8 MiB segments against 512 KiB (UCX's default, which the
    # loop's worker keeps: its progress is cut into slices), 64 MiB pulls in 8 MiB chunks,
    # paired (bench/experiments/kvtransfer_ab.py): 0.973x as long.
    config: ClassVar[dict[str, str]] = {"CMA_SEG_SIZE": "8m"}

    def __init__(self, loop: asyncio.AbstractEventLoop, number: int = 1) -> None:
        self.number = number  # its thread is "ucx-lane-<number>"
        super().__init__(loop)

    def _start(self) -> None:
        # UCX calls and _pending, between the loop and the thread. A call into UCX from the
        # loop while the thread progressed could see an endpoint fail between the check that
        # it is alive and the call (ucxx marks it failed in progress): a stream send on such an
        # endpoint spun forever inside UCX (`ucp_proto_reconfig_progress`), holding the worker.
        self.calls = self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        name = f"ucx-lane-{self.number}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def listen(self, handler, port: int = 0) -> UcxListener:
        raise NotImplementedError("a lane only connects (it would accept on its own thread)")

    def kick(self) -> None:
        """Wake the thread to progress (from the loop, after a request was made)."""
        with contextlib.suppress(OSError):  # a wake-up is pending already, or closed
            os.write(self._wake_w, b"\0")

    def track(self, request, buffer, then: Callable | None = None) -> asyncio.Future:
        with self._lock:
            return super().track(request, buffer, then)

    def _completed(self) -> list[tuple]:
        with self._lock:
            return super()._completed()

    def _run(self) -> None:
        try:
            self._progress_until_closed()
        except Exception:  # nothing settles any more: each wait ends by its own timeout
            log.exception("UCX lane stopped")

    def _progress_until_closed(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed:
            # Completions are handed to the loop every slice: a chunk's is seen while the next
            # is being copied.
            deadline = time.perf_counter() + PROGRESS_SLICE_S
            while self._locked(self.worker.progress_once):
                if time.perf_counter() > deadline:
                    self._hand_over()
                    deadline = time.perf_counter() + PROGRESS_SLICE_S
            self._locked(self.worker.progress)  # ucxx's upkeep
            self._hand_over()
            if not self._locked(self.worker.arm):
                continue  # events came in meanwhile
            poller.poll()  # lets go of the GIL
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass

    def _locked(self, call):
        with self._lock:
            return call()

    def _hand_over(self) -> None:
        """The completed requests to the loop, each with what its `then` made of its buffer
        (here, on this thread, while the bytes it just copied are likely in cache)."""
        done = [(r, f, _after(r, buffer, then)) for r, f, buffer, then in self._completed()]
        if done:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                self.loop.call_soon_threadsafe(_settle_all, done)

    def _stop(self) -> None:
        self.kick()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _fail(future: asyncio.Future, error: Exception) -> None:
    """Fail a future, marked as seen: a waiter still gets the error, and one that gave up
    (an abandoned receive) leaves no "exception was never retrieved" behind."""
    future.set_exception(error)
    future.exception()


def _after(request, buffer, then: Callable | None):
    """then(buffer) for a request that completed without error, else None."""
    if then is None:
        return None
    try:
        request.check_error()
    except Exception:
        return None
    return then(buffer)


def _settle_all(done: list[tuple]) -> None:
    for request, future, value in done:
        _settle(request, future, value)


def _settle(request, future: asyncio.Future, value=None) -> None:
    if future.done():  # nobody waits any more: the request only had to complete
        return
    try:
        request.check_error()
    except Exception as e:
        _fail(future, ConnectionError(str(e) or type(e).__name__))
    else:
        future.set_result(value)


class UcxListener:
    def __init__(self, worker: UcxWorker, handler) -> None:
        self.worker, self.handler = worker, handler
        self.listener = None
        self.binding: ucx_bind.Binding | None = None  # listening on one address alone
        self._tasks: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        return self.listener.port

    def accepted_request(self, endpoint_api, conn_request: int) -> None:
        """A connection request on a listener bound to one address: its endpoint, as ucxx's
        own callback would make it (peer failure handled), then `accepted`."""
        if self.listener is None:
            return
        self.accepted(endpoint_api.create_from_conn_request(self.listener, conn_request, True))

    def accepted(self, ep) -> None:
        """A new connection (called while the worker progresses): its handshake, then the
        handler, as a task."""
        task = self.worker.loop.create_task(self._handshake(ep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handshake(self, ep) -> None:
        w = self.worker
        hello = np.zeros(1, dtype="<u8")
        try:
            await asyncio.wait_for(w.track(ep.stream_recv(w.array(hello)), hello), ACCEPT_TIMEOUT_S)
        except Exception as e:
            log.debug("a UCX connection ended before its handshake: %s", e)
            _abort(ep)
            return
        conn_id = int(hello[0])
        ok = 0 < conn_id < 1 << ID_BITS and conn_id not in w._ids[True]
        answer = np.array([conn_id if ok else 0], dtype="<u8")
        endpoint = UcxEndpoint(w, ep, conn_id if ok else 0, listening=True)
        try:
            await w.track(ep.stream_send(w.array(answer)), answer)
        except Exception as e:
            log.debug("a UCX connection ended in its handshake: %s", e)
            endpoint.abort()
            return
        if not ok:  # the peer sees the refusal and tries another id
            endpoint.abort()
            return
        w._ids[True].add(conn_id)
        await self.handler(endpoint)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.binding is not None:
            self.binding.close()
        self.listener = None  # ucxx stops listening when its listener is freed


class UcxEndpoint:
    """One connection: tagged messages in its own namespace."""

    def __init__(self, worker: UcxWorker, ep, conn_id: int, listening: bool) -> None:
        self.worker, self._ep, self.conn_id, self.listening = worker, ep, conn_id, listening
        base = conn_id << TAG_BITS
        self._send_base = base if listening else base | TO_LISTENER
        self._recv_base = base | TO_LISTENER if listening else base
        self._aborted = False
        worker._endpoints.add(self)

    @property
    def ucp_handle(self) -> int:
        """The UCP endpoint (`ucp_ep_h`) as an integer, for UCX's own C API."""
        return self._ep.handle

    @property
    def closed(self) -> bool:
        return self._aborted or not self._ep.alive

    def _refused(self) -> asyncio.Future:
        future = self.worker.loop.create_future()
        _fail(future, ConnectionError("UCX endpoint closed"))
        return future

    def send(self, buffer, tag: int = 0) -> asyncio.Future:
        """Send the buffer on `tag` (under 2**32); a future of the send's completion (failed
        at once on a closed endpoint)."""
        w = self.worker
        with w.calls:
            if self.closed:
                return self._refused()
            request = self._ep.tag_send(w.array(buffer), w.tag(self._send_base | (tag & TAG_MASK)))
        return w.track(request, buffer)

    def recv(self, buffer, tag: int = 0, then: Callable | None = None) -> asyncio.Future:
        """Receive the message sent on `tag` into the buffer; a future of its completion, with
        `then(buffer)` as its result (run by the thread that progressed the receive, as soon
        as it completed: the loop, or a lane's thread)."""
        w = self.worker
        with w.calls:
            if self.closed:
                return self._refused()
            request = self._ep.tag_recv(
                w.array(buffer), w.tag(self._recv_base | (tag & TAG_MASK)), w._mask
            )
        return w.track(request, buffer, then)

    def abort(self) -> None:
        """Close at once: UCX completes this connection's requests with an error."""
        if self._aborted:
            return
        self._aborted = True
        self.worker._ids[self.listening].discard(self.conn_id)
        with self.worker.calls:  # on a lane: no copy into this process after this returns
            _abort(self._ep)
        self.worker.kick()

    async def close(self) -> None:
        self.abort()


def _abort(ep) -> None:
    """Close an endpoint unless UCX closed it on an error already (closing it again crashes),
    first ending the requests still in flight on it: a receive whose message never came would
    otherwise stay posted (UCX matches tags per worker, and closing the endpoint leaves it), its
    buffer referenced, where a message of the old connection arriving late could still land."""
    if not ep.alive:
        return
    cancel = _inflight_canceller()
    if cancel is not None:
        cancel(ep.ucxx_ptr)
    try:
        ep.close()
    except Exception as e:
        log.debug("UCX endpoint close: %s", e)


@functools.cache
def _inflight_canceller():
    """ucxx's `Endpoint::cancelInflightRequests` (C++; its Python API has no way to cancel a
    request), through its exported symbol; None, with a warning, where this ucxx lacks it."""
    try:
        import libucxx

        cancel = libucxx.load_library()["_ZN4ucxx8Endpoint22cancelInflightRequestsEv"]
    except (ImportError, OSError, AttributeError, TypeError) as e:
        log.warning("cannot cancel a UCX endpoint's requests (%s): an aborted one's stay posted", e)
        return None
    cancel.restype = ctypes.c_size_t
    cancel.argtypes = [ctypes.c_void_p]
    return cancel
