"""A chunk's checksum is CRC-32C, and where large chunks are hashed off a UCX pull (the gRPC
fallback, a source's blocks): a checksum thread, or the event loop in a one-core process."""

from __future__ import annotations

import asyncio
import threading

import crc32c
import numpy as np
import pytest

from services.kvtransfer import checksums


def test_the_checksum_is_crc32c():
    assert checksums.checksum_of(np.frombuffer(b"123456789", dtype=np.uint8)) == 0xE3069283


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may run on `n` cores (the decision is taken at first use)."""

    def set_cores(n: int) -> None:
        monkeypatch.setattr(checksums, "_one_core", None)
        monkeypatch.setattr(checksums, "_checksum_threads", None)
        monkeypatch.setattr(checksums.os, "sched_getaffinity", lambda pid: set(range(n)))

    return set_cores


def run(fn, *args):
    async def go():
        job = checksums.on_checksum_thread(fn, *args)
        done_at_once = job.done()
        return done_at_once, await job

    return asyncio.run(go())


def test_a_pinned_process_hashes_on_the_loop(cores):
    cores(1)
    data = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)
    done_at_once, (digest, thread) = run(
        lambda: (checksums.checksum_of(data), threading.get_ident())
    )
    assert done_at_once and thread == threading.get_ident()
    assert digest == crc32c.crc32c(data.tobytes())
    assert checksums._checksum_threads is None  # no thread started at all

    def broken():
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        run(broken)


def test_a_process_with_cores_to_spare_hashes_on_a_thread(cores):
    cores(4)
    done_at_once, thread = run(threading.get_ident)
    assert not done_at_once and thread != threading.get_ident()
    assert checksums._checksum_threads is not None
    checksums._checksum_threads.shutdown()
