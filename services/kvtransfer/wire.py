"""Fixed-size frames for the UCX data plane's small messages.

Each request and status is one UCX message of FRAME_BYTES: a 4-byte little-endian length, then a
serialized protobuf (KvChunkRequest or KvChunkStatus), then padding. Fixed sizes let many
requests share one endpoint without interleaving, and nothing is ever unpickled.
"""

from __future__ import annotations

import asyncio
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import xxhash

from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import kvtransfer_pb2

FRAME_BYTES = 1024  # a status with MAX_CHUNKS checksums, a request with as many ranges
# Chunks at least this large are checksummed on a checksum thread (xxhash releases the GIL), so
# that the event loop goes on moving other chunks meanwhile; a smaller one costs less than the
# hop (~60 us of the loop's time and a thread wake-up, against ~25 us to hash 512 KiB). Pulls of
# 24 chunks of 512 KiB, alternated in one process pair: 6.4 / 7.3 ms with the threshold at 256
# KiB, 5.4 / 6.4 ms at 1 MiB. A UCX pull hands each large chunk to the thread as it arrives and
# takes back, once the copying is over, those no thread has started (`ChecksumJob`).
THREAD_CHECKSUM_BYTES = 2**20
# ... and only when it is hashed in pieces at least this large. A chunk checked block by block is
# one xxh3 call per block, and each call lets go of the GIL and takes it back: on a thread, beside
# an event loop busy with the copying, each taking back waits for the loop. The `small` preset's
# blocks are 16 KiB a layer (16 tokens, 4 KV heads of 64 fp32): its pulls of 2 MiB chunks ran 1.5x
# as long checksummed as not, and 0.906x / 0.914x as long hashed on the loop instead of the
# thread; 48 KiB blocks in 8 MiB chunks 0.938x; 512 KiB blocks 0.955x, 1.026x (64 MiB) and
# 1.064x (256 MiB): the thread still pays there (bench/kvtransfer_ab.py, paired; with this
# rule, 16 KiB blocks in 2 MiB chunks 0.849x and 0.80x, 48 KiB in 8 MiB 0.944x).
THREAD_PIECE_BYTES = 256 * 2**10
# Those threads: one per four cores this process may run on, at least one. asyncio's default
# pool (cores + 4 threads) let six hashes run at once on two cores, each taking the core from
# the thread that does the copying (then UCX's progress thread; the event loop since UCX runs
# on it, services/kvtransfer/ucx_loop.py): a pull of 64 MiB over shared memory went from
# 4.2-4.3 GB/s to 4.6-4.7 with one thread, the puller's CPU from 19.5 to 17.9 ms a pull
# (docs/benchmarks.md). xxh3 hashes ~30 GB/s a thread, faster than any copy on the same cores.
# None at all in a process with one core (a `--pin` worker): a thread there cannot run beside
# the loop, it only adds hops to the same work (a job started 1-2.5 ms after it was handed
# over, waiting for the GIL and the core); hashing on the loop made the pinned mesh's 2048-token
# handoff 0.76x and 0.95x as long in two runs, 0.88x pooled (bench/handoff_env.py, 24 paired
# pulls a run). Sized at first use, after a `--pin` worker has pinned itself.
_checksum_threads: ThreadPoolExecutor | None = None
_one_core: bool | None = None


def _threads() -> ThreadPoolExecutor | None:
    """The checksum threads; None in a process with one core."""
    global _checksum_threads, _one_core
    if _one_core is None:
        cores = len(os.sched_getaffinity(0))
        _one_core = cores == 1
        if not _one_core:
            _checksum_threads = ThreadPoolExecutor(max(1, cores // 4), "kv-checksum")
    return _checksum_threads


def on_checksum_thread(fn, *args) -> asyncio.Future:
    """fn(*args) on a checksum thread, as a future of the running loop's; run at once, on the
    loop, in a process with one core."""
    threads = _threads()
    if threads is None:
        return _ran(asyncio.get_running_loop().create_future(), fn, args)
    return asyncio.wrap_future(threads.submit(fn, *args))


def _ran(future, fn, args):
    try:
        future.set_result(fn(*args))
    except Exception as e:  # as the thread pool would: the error through the future
        future.set_exception(e)
    return future


class ChecksumJob:
    """fn(*args) handed to a checksum thread (run at once in a process with one core), which
    the caller may take back and run itself while no thread has started it: at the end of a
    pull, when the loop has no more copying to do, it hashes the last chunks beside the thread
    instead of waiting for the thread to hash them one after the other."""

    def __init__(self, fn, *args) -> None:
        self._fn, self._args = fn, args
        threads = _threads()
        self._future = _ran(Future(), fn, args) if threads is None else threads.submit(fn, *args)

    def take_back(self) -> bool:
        """Run it here, now, unless a thread has started it; whether it ran here."""
        if not self._future.cancel():
            return False
        self._future = _ran(Future(), self._fn, self._args)
        return True

    async def result(self):
        if self._future.done():  # as most are by then: no hop through the loop (~40 us each)
            return self._future.result()
        return await asyncio.wrap_future(self._future)


def encode(message) -> np.ndarray:
    body = message.SerializeToString()
    if len(body) + 4 > FRAME_BYTES:
        raise InvalidRequest(f"frame of {len(body)} bytes exceeds {FRAME_BYTES - 4}")
    frame = np.zeros(FRAME_BYTES, dtype=np.uint8)
    frame[:4] = np.frombuffer(struct.pack("<I", len(body)), dtype=np.uint8)
    frame[4 : 4 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    return frame


def decode(frame: np.ndarray, message_type):
    (n,) = struct.unpack("<I", frame[:4].tobytes())
    if n > FRAME_BYTES - 4:
        raise InvalidRequest("malformed frame: length exceeds the frame")
    message = message_type()
    message.ParseFromString(frame[4 : 4 + n].tobytes())
    return message


def empty_frame() -> np.ndarray:
    return np.empty(FRAME_BYTES, dtype=np.uint8)


ChunkRequest = kvtransfer_pb2.KvChunkRequest
ChunkRange = kvtransfer_pb2.KvChunkRange
ChunkStatus = kvtransfer_pb2.KvChunkStatus


def checksum_of(data: np.ndarray) -> int:
    """xxh3-64 of a chunk's bytes: what a source sends with a chunk and a puller verifies."""
    return xxhash.xxh3_64_intdigest(data)


async def checksum(data: np.ndarray) -> int:
    """`checksum_of`, on a checksum thread when the chunk is large."""
    if data.nbytes < THREAD_CHECKSUM_BYTES:
        return checksum_of(data)
    return await on_checksum_thread(checksum_of, data)


def digest_of(block_digests: np.ndarray) -> int:
    """A chunk's checksum from its blocks' xxh3-64s (uint64, in order): their xxh3-64."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(block_digests, dtype="<u8"))


def block_checksum_of(data: np.ndarray, blocks: int) -> int:
    """What a source sends as the checksum of a chunk of `blocks` equal blocks when it took
    its blocks' checksums as they were computed (`block_checksums`)."""
    rows = data.reshape(blocks, -1)
    return digest_of(np.array([xxhash.xxh3_64_intdigest(r) for r in rows], dtype=np.uint64))


async def block_checksum(data: np.ndarray, blocks: int) -> int:
    """`block_checksum_of`, on a checksum thread when the chunk is large."""
    if data.nbytes < THREAD_CHECKSUM_BYTES:
        return block_checksum_of(data, blocks)
    return await on_checksum_thread(block_checksum_of, data, blocks)
