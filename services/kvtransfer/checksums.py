"""A chunk's checksum (CRC-32C of its bytes) and the threads that take it off the event loop.

What a source sends with each chunk and a puller verifies; the source's side combines it from
its blocks' (services/kvtransfer/crc_combine.py).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np

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
# (`python bench/kvtransfer/kvtransfer.py` measures a pull today). CRC-32C runs at ~22 GB/s a
# thread, faster than any copy on the same cores.
# None at all in a process with one core (a `--pin` worker): a thread there cannot run beside
# the loop, it only adds hops to the same work (a job started 1-2.5 ms after it was handed
# over, waiting for the GIL and the core); hashing on the loop made the pinned mesh's 2048-token
# handoff 0.76x and 0.95x as long in two runs, 0.88x pooled (bench/experiments/handoff_env.py, 24
# paired pulls a run). Sized at first use, after a `--pin` worker has pinned itself.
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


def checksum_of(data: np.ndarray) -> int:
    """CRC-32C of a chunk's bytes: what a source sends with a chunk and a puller verifies (the
    crc32c package: SSE4.2 / ARMv8 instructions, the GIL let go from 32 KiB)."""
    return crc32c.crc32c(data)


async def checksum(data: np.ndarray) -> int:
    """`checksum_of`, on a checksum thread when the chunk is large."""
    if data.nbytes < THREAD_CHECKSUM_BYTES:
        return checksum_of(data)
    return await on_checksum_thread(checksum_of, data)
