"""How chunks travel: UCX (zero-copy into the destination) or the gRPC fallback.

`fetch(handle, source, request, buffers, gate, timeout_s, digest)` asks a source rank for the
request's chunks (up to `max_chunks`) and fills `buffers` with their bytes, each received under a
permit of `gate` (the puller's window) and within `timeout_s` of its start; it returns a
`Fetched`: the source's status, if it came, and per chunk whether its bytes arrived and, with
`digest(i)`, chunk i's checksum as received (computed as each arrives). A broken connection is
forgotten, so the next attempt reconnects. Retries and the checks are the puller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from services.common.errors import Unavailable
from services.common.gen.distserve.v1 import kvtransfer_pb2_grpc
from services.common.kv_handle import KvHandle, RankSource
from services.kvtransfer import wire
from services.kvtransfer.source import MAX_CHUNKS

log = logging.getLogger("distserve.kvtransfer")

# After a failed or abandoned attempt, how long to wait for the source's answer to it before
# the endpoint is given up (aborting it is the only way to be sure nothing lands later).
DRAIN_S = 0.25
# ucxx's connection handshake (exchange_peer_info) receives the peer's 16 bytes into a bytearray
# of its coroutine; if that coroutine ends while the receive is still posted (its own timeout
# ran out, or its caller was cancelled), the bytearray is freed and a peer that answers later (a
# cut link restored) writes into freed memory: seen as decode instances dying of a general
# protection fault in _PyObject_Malloc (tests/multihost, about 1 run in 3). So a handshake is
# never abandoned: it runs as a task of its own that nobody cancels, with a timeout of ucxx's own
# far beyond any real answer (a dead or unreachable peer fails the endpoint before: UCX's error
# handling completes the receive with an error, which is safe); only the waits for it are short.
# One that has not answered within HANDSHAKE_REUSE_S (one begun while a link was down may hang
# long after it is back) is left to finish on its own, and the next attempt starts another.
HANDSHAKE_TIMEOUT_S = 300.0
HANDSHAKE_REUSE_S = 1.0


def shutdown_ucx() -> None:
    """Stop ucxx's notifier thread, which is not a daemon: without this a process that used
    UCX never exits."""
    import sys

    ucxx = sys.modules.get("ucxx")
    if ucxx is not None:
        ucxx.stop_notifier_thread()


def add_ucx_args(p) -> None:
    p.add_argument(
        "--ucx-tls",
        default="",
        help="UCX transports (UCX_TLS), e.g. tcp; sm,tcp; rc,cuda_copy,cuda_ipc (default: UCX's "
        "choice: shared memory on one host, RDMA or tcp across hosts, CUDA paths on GPUs)",
    )


# The settings every process of the mesh runs UCX with, unless its environment says otherwise.
UCX_DEFAULTS = {
    # ucxx's own defaults wait for each request with `sleep(0)` in a loop, so a pending receive
    # (one is always pending in a prefill instance) pins a core. Python futures completed by
    # ucxx's notifier thread leave an idle process idle; requests are submitted at once rather
    # than through the progress thread (delayed submission adds milliseconds).
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    "UCXPY_ENABLE_DELAYED_SUBMISSION": "0",
    # Shared memory between processes of one host. UCX leaves its shared-memory transports
    # (posix, sysv) out of any endpoint that handles peer failure, and every endpoint ucxx
    # creates from a listener does: without this, KV between two processes of one host moves
    # over TCP on the loopback device (measured here: 1.1-1.2 GB/s against 5.8-6.7 GB/s, memcpy
    # 8-10 GB/s). A dead peer is still noticed: its endpoint fails by UCX's keepalive, and a
    # chunk's own timeout bounds every wait.
    "UCX_MM_ERROR_HANDLING": "y",
    # A single copy between processes of one host: the puller reads the source's KV straight
    # into its blocks (CMA, process_vm_readv) instead of both sides copying through a shared-
    # memory bounce buffer. UCX offers CMA for rendezvous on endpoints that handle peer failure
    # only if its memory domain declares it can invalidate a buffer once a send is cancelled,
    # which CMA's does only when told (this setting): it does not actually invalidate. A
    # cancelled send's blocks may therefore still be read by the puller after the source frees
    # them; no such read is ever used, because a source answers "ok" only after every send of
    # a request completed (the puller has acknowledged reading each), and a request cut off
    # (lease released, lapsed or drained) is refused (the same holds for the bounce buffer: a
    # cut-off send may still copy from freed blocks). Measured here, 64 MiB pulls on 2 cores:
    # the source's CPU per pull 19 -> 6 ms, a pull 2.1-2.9 -> 3.7-4.1 GB/s (docs/benchmarks.md).
    # Where CMA is not allowed (ptrace restricted, another PID namespace) UCX keeps to shared
    # memory.
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    # A mutex, not a spinlock, guards the UCX worker that the event loop's thread and UCX's
    # progress thread share. A `--pin` worker runs both on one core: with a spinlock, a thread
    # that finds the lock taken spins out its time slice while the holder waits for the core.
    # ucxx alone, both processes pinned, 12 MiB in 2 messages: 8.1 -> 2.4 ms a round, the
    # event loop's thread 7.1 -> 0.4 ms of CPU; in 24: 11.3 -> 5.6 ms. A 24-chunk pull pinned:
    # 10.9 / 8.2 / 12.7 / 7.9 -> 9.0 / 8.0 / 7.8 / 7.7 ms alternated; unpinned, no change. The
    # real pinned mesh's 512-token handoff, two meshes alternated: 14.2 / 17.0 / 13.0 -> 13.1 /
    # 14.5 / 11.1 ms (docs/benchmarks.md).
    "UCX_USE_MT_MUTEX": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


def configure_ucx(args=None) -> None:
    """Set UCX_DEFAULTS where the environment has no value, and apply --ucx-tls; before ucxx is
    first used (UCX reads its environment when its context starts)."""
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if args is not None and args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls


Digest = Callable[[int], Awaitable[int]]  # chunk i's checksum as received


@dataclass
class Fetched:
    """What one request brought: the source's status (None when none came) and, per chunk,
    why its bytes did not arrive (None: they did) and their checksum as received."""

    status: wire.ChunkStatus | None
    errors: list[BaseException | None]
    digests: list[int | None]


def ucx_available() -> bool:
    try:
        import ucxx  # noqa: F401
    except ImportError:
        return False
    return True


class UcxTransport:
    """One cached endpoint per peer; a request frame for many chunks, their raw bytes received
    straight into the destination, then one status frame."""

    name = "ucx"
    max_chunks = MAX_CHUNKS

    def __init__(self) -> None:
        self._endpoints: dict[tuple[str, int], object] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._handshakes: dict[tuple[str, int], tuple[asyncio.Task, float]] = {}  # newest, started
        self._unfinished: set[asyncio.Task] = set()  # every handshake until it ends
        self._connected: set[tuple[str, int]] = set()  # peers reached before
        self._next_tag = 1
        self.reconnects = 0
        # Receives given up on, with their buffers: UCX may still write into those until it
        # completes the requests (with an error, once the endpoint is aborted), so nothing of
        # theirs may be freed before. Never cancelled: a cancelled receive loses its buffer.
        self._abandoned: dict[int, tuple] = {}  # by id: buffers are numpy arrays (unhashable)

    async def warm_up(self, host: str = "127.0.0.1") -> None:
        """Connect once to ourselves: a process's first UCX connection sets up its worker and
        transports (measured: ~180 ms here, then ~3-60 ms per new peer), which would otherwise
        land in the first request's handoff."""
        import ucxx

        accepted = asyncio.Event()

        async def accept(ep) -> None:
            accepted.set()

        listener = ucxx.create_listener(accept, 0)
        try:
            ep = await ucxx.create_endpoint(_connectable(host), listener.port)
            # The listener's handler must have run and retired before it closes (else UCX
            # warns that a client handler is still alive).
            await asyncio.wait_for(accepted.wait(), 5)
            await ep.close()
            for _ in range(3):
                await asyncio.sleep(0)
        finally:
            listener.close()

    async def fetch(
        self,
        handle: KvHandle,
        source: RankSource,
        request,
        buffers: list,
        gate: asyncio.Semaphore,
        timeout_s: float,
        digest: Digest | None = None,
    ) -> Fetched:
        key = (source.ucx_host, source.ucx_port)
        try:
            ep = await asyncio.wait_for(self._endpoint(*key), timeout_s)
        except TimeoutError:
            raise Unavailable(
                f"no connection to the KV source at {key[0]}:{key[1]} within {timeout_s} s"
            ) from None
        tag, self._next_tag = self._next_tag, self._next_tag + len(buffers)
        request.tag = tag
        status_frame = wire.empty_frame()
        # Posted before the request goes out (a refusal comes at once); each data receive is
        # posted once the window has room, and the source's send waits for it.
        status_recv = asyncio.ensure_future(ep.recv(status_frame, tag=2 * tag))
        receives: list[asyncio.Future] = []
        errors: list[BaseException | None] = [None] * len(buffers)
        digests: list[int | None] = [None] * len(buffers)

        async def one(i: int) -> None:
            async with gate:
                recv = asyncio.ensure_future(ep.recv(buffers[i], tag=2 * (tag + i) + 1))
                receives.append(recv)
                # Waited for, never cancelled (see _abandoned): `wait` leaves it running.
                await asyncio.wait((recv,), timeout=timeout_s)
            if not recv.done():
                errors[i] = TimeoutError(f"no data within {timeout_s} s")
                return
            error = ConnectionError("receive cancelled") if recv.cancelled() else recv.exception()
            if error is not None:  # the connection broke: closed, reset, peer gone
                errors[i] = error
                return
            if digest is not None:
                digests[i] = await digest(i)

        status = None
        broken = False
        frame = wire.encode(request)
        try:
            await asyncio.wait_for(ep.send(frame), timeout_s)
            await asyncio.gather(*(one(i) for i in range(len(buffers))))
            await asyncio.wait_for(asyncio.shield(status_recv), timeout_s)
            status = wire.decode(status_frame, wire.ChunkStatus)
        except Exception as e:  # no status: late, or the connection broke
            broken = not isinstance(e, TimeoutError)
            errors = [error or e for error in errors]
        finally:
            # Nothing of this attempt may land in the destination afterwards: if every receive
            # completes at once the endpoint is clean and stays (other pulls share it); if not
            # (a chunk never sent, a late source) or it broke, it is dropped and aborted.
            posted = (status_recv, *receives)
            broken = broken or any(
                e is not None and not isinstance(e, TimeoutError) for e in errors
            )
            if not await _drained(*posted) or broken:
                self._abandon(frame, status_frame, buffers, *posted)
                self._drop(key, ep)
        return Fetched(status, errors, digests)

    def _abandon(self, *keep) -> None:
        receives = [k for k in keep if isinstance(k, asyncio.Future)]
        entry = tuple(keep)
        self._abandoned[id(entry)] = entry

        def settled(_) -> None:
            if all(r.done() for r in receives):
                self._abandoned.pop(id(entry), None)
                for r in receives:  # retrieve: errors of abandoned receives are expected
                    if not r.cancelled():
                        r.exception()

        for r in receives:
            r.add_done_callback(settled)

    async def close(self) -> None:
        for ep in self._endpoints.values():
            with contextlib.suppress(Exception):
                await ep.close()
        self._endpoints.clear()

    async def _endpoint(self, host: str, port: int):
        """The cached endpoint to a peer, connecting (again) when there is none or it closed:
        a peer that restarted gets a fresh endpoint, never stale state."""
        import ucxx

        key = (host, port)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(key)
            if ep is not None and not ep.closed:
                return ep
            now = asyncio.get_running_loop().time()
            handshake, started = self._handshakes.get(key, (None, 0.0))
            if handshake is None or now - started > HANDSHAKE_REUSE_S:
                # See HANDSHAKE_TIMEOUT_S: never cancelled; adopted when it ends.
                handshake = asyncio.ensure_future(
                    ucxx.create_endpoint(host, port, connect_timeout=HANDSHAKE_TIMEOUT_S)
                )
                self._handshakes[key] = (handshake, now)
                self._unfinished.add(handshake)
                handshake.add_done_callback(lambda task: self._adopt(key, task))
            try:
                await asyncio.shield(handshake)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise Unavailable(f"cannot reach the KV source at {host}:{port}: {e}") from e
            # `_adopt` ran first: a future's callbacks run in the order they were added.
            ep = self._endpoints.get(key)
            if ep is None:  # dropped meanwhile by a failed attempt
                raise Unavailable(f"the endpoint to the KV source at {host}:{port} broke")
            return ep

    def _adopt(self, key: tuple[str, int], handshake: asyncio.Task) -> None:
        """A finished handshake's endpoint becomes the peer's cached one, unless a live one is
        cached already (then it is aborted: a late handshake); so an endpoint whose waiters all
        gave up is kept or aborted, never leaked."""
        self._unfinished.discard(handshake)
        if self._handshakes.get(key, (None,))[0] is handshake:
            del self._handshakes[key]
        if handshake.cancelled() or handshake.exception() is not None:
            return
        ep, current = handshake.result(), self._endpoints.get(key)
        if current is not None and not current.closed:
            if not ep.closed:
                ep.abort()
            return
        if key in self._connected:
            self.reconnects += 1
        self._connected.add(key)
        self._endpoints[key] = ep

    def _drop(self, key: tuple[str, int], ep) -> None:
        """Forget a broken endpoint (only if it is still the cached one) and abort it, unless
        UCX already closed it on an error (its error callback ran: the receives posted on it
        are completed with an error: aborting it again is not needed, and ucxx has had crashes
        in aborting endpoints). The general protection faults once blamed on this were the
        abandoned handshakes of HANDSHAKE_TIMEOUT_S."""
        if self._endpoints.get(key) is ep:
            del self._endpoints[key]
        if ep.closed:
            return
        with contextlib.suppress(Exception):
            ep.abort()


async def _drained(*receives: asyncio.Future) -> bool:
    """Whether an attempt's posted receives completed without error (waiting up to DRAIN_S for
    those still pending); they are never cancelled (see UcxTransport._abandoned). Judged by
    their state, not by whether a wait ended first: a `wait_for` over receives that had all
    completed could still time out on a loop busy for longer than DRAIN_S (seen under 2x CPU
    oversubscription), and the healthy endpoint every other pull shared was then dropped."""
    pending = [r for r in receives if not r.done()]
    if pending:
        await asyncio.wait(pending, timeout=DRAIN_S)
    return all(r.done() and not r.cancelled() and r.exception() is None for r in receives)


class GrpcTransport:
    """The fallback: KvTransfer.FetchChunk on the source's control address, one chunk a call,
    the bytes copied."""

    name = "grpc"
    max_chunks = 1

    def __init__(self, channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._channel = channel
        self.reconnects = 0

    @staticmethod
    def serves(handle: KvHandle) -> bool:
        return bool(handle.control_address)

    async def fetch(
        self,
        handle: KvHandle,
        source: RankSource,
        request,
        buffers: list,
        gate: asyncio.Semaphore,
        timeout_s: float,
        digest: Digest | None = None,
    ) -> Fetched:
        (dst,) = buffers
        stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(handle.control_address))
        async with gate:
            try:
                reply = await stub.FetchChunk(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                return Fetched(None, [Exception(f"{e.code().name}: {e.details()}")], [None])
        if reply.status.ok and len(reply.data) == dst.nbytes:
            np.copyto(dst, np.frombuffer(reply.data, dtype=np.uint8))
        received = await digest(0) if digest is not None and reply.status.ok else None
        return Fetched(reply.status, [None], [received])

    async def close(self) -> None:
        pass


def _connectable(host: str) -> str:
    """An address to reach a listener bound to all interfaces on `host`'s side."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)
