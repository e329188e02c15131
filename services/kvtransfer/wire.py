"""Fixed-size frames for the UCX data plane's small messages.

Each request and status is one UCX message of FRAME_BYTES: a 4-byte little-endian length, then a
serialized protobuf (KvChunkRequest or KvChunkStatus), then padding. Fixed sizes let many
requests share one endpoint without interleaving, and nothing is ever unpickled.
"""

from __future__ import annotations

import asyncio
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np

from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import kvtransfer_pb2

FRAME_BYTES = 1024  # a status with MAX_CHUNKS checksums, a request with as many ranges
# Chunks at least this large are checksummed on a checksum thread (crc32c lets go of the GIL), so
# that the event loop goes on meanwhile; a smaller one costs less than the hop (~60 us of the
# loop's time and a thread wake-up, against ~25 us to hash 512 KiB). Pulls of 24 chunks of 512
# KiB, alternated in one process pair: 6.4 / 7.3 ms with the threshold at 256 KiB, 5.4 / 6.4 ms
# at 1 MiB. (A UCX pull does not use them: each chunk is hashed by the thread that copied it,
# services/kvtransfer/transports.py; the gRPC fallback and a source's copies of a sub-range of
# the heads do, and a source's block checksums as layers are published.)
THREAD_CHECKSUM_BYTES = 2**20
# Those threads: one per four cores this process may run on, at least one. asyncio's default
# pool (cores + 4 threads) let six hashes run at once on two cores, each taking the core from
# the thread that does the copying (then UCX's progress thread; the event loop since UCX runs
# on it, services/kvtransfer/ucx_loop.py): a pull of 64 MiB over shared memory went from
# 4.2-4.3 GB/s to 4.6-4.7 with one thread, the puller's CPU from 19.5 to 17.9 ms a pull
# (`python bench/kvtransfer.py` measures a pull today). CRC-32C runs at ~22 GB/s a thread,
# faster than any copy on the same cores.
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
    """CRC-32C of a chunk's bytes: what a source sends with a chunk and a puller verifies (the
    crc32c package: SSE4.2 / ARMv8 instructions, the GIL let go from 32 KiB)."""
    return crc32c.crc32c(data)


async def checksum(data: np.ndarray) -> int:
    """`checksum_of`, on a checksum thread when the chunk is large."""
    if data.nbytes < THREAD_CHECKSUM_BYTES:
        return checksum_of(data)
    return await on_checksum_thread(checksum_of, data)


# -- a chunk's CRC from its blocks' ----------------------------------------------------------------
# CRC-32C is linear: crc(A + B) = Z(crc(A)) ^ crc(B), Z being what len(B) zero bytes do to a CRC
# (a 32x32 bit matrix; the CRC's initial and final inversions cancel out, as in zlib's
# crc32_combine). So a source that took each block's CRC when the layer was computed gives the
# CRC of any run of its blocks without reading their bytes again, and the puller checks a chunk
# with one call over its bytes. Z applied to a CRC is four table look-ups, one per byte of it.

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_GROUP = 256  # pieces combined by one look-up each; more pieces are combined in groups of this
_BYTES = np.array([0, 8, 16, 24], dtype=np.uint32)
_BYTE_TABLES = np.arange(4) * 256  # where each byte of a CRC has its 256 entries in a table
# _table(n)[k * 1024 + j * 256 + b]: what k pieces of n bytes after one make of byte j = b of
# its CRC. Piece i of a group has _GROUP - 1 - i after it: _OFFSETS[i, j] is where its look-ups
# for byte j start.
_OFFSETS = ((_GROUP - 1 - np.arange(_GROUP)) * 1024)[:, None] + _BYTE_TABLES
_tables: dict[int, np.ndarray] = {}  # piece bytes -> (_GROUP * 4 * 256) uint32


def _times(columns: list[int], x: int) -> int:
    out = 0
    for column in columns:
        if not x:
            break
        if x & 1:
            out ^= column
        x >>= 1
    return out


def _zeros(nbytes: int) -> list[int]:
    """What nbytes zero bytes do to a CRC: the images of its 32 bits."""
    op = [_POLY] + [1 << k for k in range(31)]  # one zero bit
    for _ in range(3):
        op = [_times(op, c) for c in op]  # squared: 2, 4, 8 bits
    out = [1 << k for k in range(32)]
    while nbytes:
        if nbytes & 1:
            out = [_times(op, c) for c in out]
        op = [_times(op, c) for c in op]
        nbytes >>= 1
    return out


def prepare(nbytes: int) -> None:
    """Make the tables `combine` uses for pieces of nbytes (~25 ms each, once): runs of up to
    _GROUP pieces, and of up to _GROUP groups of them (an 8 MiB chunk of 16 KiB blocks is 512)."""
    _table(nbytes)
    _table(nbytes * _GROUP)


def _table(nbytes: int) -> np.ndarray:
    """For pieces of nbytes: what 0.._GROUP-1 pieces after one do to each byte of its CRC."""
    table = _tables.get(nbytes)
    if table is None:
        columns = np.array(_zeros(nbytes), dtype=np.uint32).reshape(4, 8)
        one = np.zeros((4, 256), dtype=np.uint32)  # one piece, by byte of the CRC
        for b in range(1, 256):
            low = b & -b
            one[:, b] = one[:, b ^ low] ^ columns[:, low.bit_length() - 1]
        table = np.empty((_GROUP, 4, 256), dtype=np.uint32)
        table[0] = np.arange(256, dtype=np.uint32) << _BYTES[:, None]  # none after it
        for k in range(1, _GROUP):
            before = table[k - 1].reshape(-1)
            table[k] = _apply(one.reshape(-1), before).reshape(4, 256)
        table = _tables[nbytes] = table.reshape(-1)
    return table


def _apply(flat: np.ndarray, crcs: np.ndarray) -> np.ndarray:
    """A (4 * 256) table applied to each CRC."""
    return np.bitwise_xor.reduce(flat[((crcs[:, None] >> _BYTES) & 0xFF) + _BYTE_TABLES], 1)


def combine(crcs, nbytes: int) -> int:
    """The CRC-32C of consecutive pieces of `nbytes` bytes each, from theirs (in order)."""
    x = np.asarray(crcs, dtype=np.uint32)
    while len(x) > _GROUP:
        groups = -(-len(x) // _GROUP)
        padded = np.zeros(groups * _GROUP, dtype=np.uint32)  # a zero CRC adds nothing
        padded[len(padded) - len(x) :] = x  # the last group full: groups end where the data does
        at = ((padded.reshape(groups, _GROUP, 1) >> _BYTES) & 0xFF) + _OFFSETS
        x = np.bitwise_xor.reduce(_table(nbytes)[at].reshape(groups, -1), 1)
        nbytes *= _GROUP
    if len(x) < 2:
        return int(x[0]) if len(x) else 0
    at = ((x[:, None] >> _BYTES) & 0xFF) + _OFFSETS[_GROUP - len(x) :]
    return int(np.bitwise_xor.reduce(_table(nbytes)[at.reshape(-1)]))
