"""Where large chunks are hashed: a checksum thread, or the event loop in a one-core process;
and a job the loop takes back from the thread."""

from __future__ import annotations

import asyncio
import threading

import crc32c
import numpy as np
import pytest

from services.kvtransfer import wire


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may run on `n` cores (the decision is taken at first use)."""

    def set_cores(n: int) -> None:
        monkeypatch.setattr(wire, "_one_core", None)
        monkeypatch.setattr(wire, "_checksum_threads", None)
        monkeypatch.setattr(wire.os, "sched_getaffinity", lambda pid: set(range(n)))

    return set_cores


def run(fn, *args):
    async def go():
        job = wire.on_checksum_thread(fn, *args)
        done_at_once = job.done()
        return done_at_once, await job

    return asyncio.run(go())


def test_a_pinned_process_hashes_on_the_loop(cores):
    cores(1)
    data = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)
    done_at_once, (digest, thread) = run(lambda: (wire.checksum_of(data), threading.get_ident()))
    assert done_at_once and thread == threading.get_ident()
    assert digest == crc32c.crc32c(data.tobytes())
    assert wire._checksum_threads is None  # no thread started at all

    def broken():
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        run(broken)


def test_a_process_with_cores_to_spare_hashes_on_a_thread(cores):
    cores(4)
    done_at_once, thread = run(threading.get_ident)
    assert not done_at_once and thread != threading.get_ident()
    assert wire._checksum_threads is not None
    wire._checksum_threads.shutdown()


def test_a_job_no_thread_has_started_is_taken_back_by_the_caller(cores):
    cores(4)  # one checksum thread
    started, release = threading.Event(), threading.Event()

    def busy():
        started.set()
        release.wait(10)
        return threading.get_ident()

    async def go():
        first = wire.ChecksumJob(busy)
        assert started.wait(10)
        second = wire.ChecksumJob(threading.get_ident)  # queued behind `first`
        taken = second.take_back()
        running = first.take_back()  # a thread runs it: it stays there
        step = second.result()  # done: its result without a hop through the loop
        with pytest.raises(StopIteration) as done:
            step.send(None)
        assert done.value.value == threading.get_ident()
        release.set()
        return taken, running, await first.result(), await second.result()

    taken, running, first_thread, second_thread = asyncio.run(go())
    assert taken and not running
    assert second_thread == threading.get_ident() != first_thread
    wire._checksum_threads.shutdown()


def test_a_pinned_process_runs_a_job_at_once(cores):
    cores(1)
    data = np.random.default_rng(1).integers(0, 255, 2 << 20, dtype=np.uint8)

    async def go():
        job = wire.ChecksumJob(wire.checksum_of, data)
        assert not job.take_back()  # done already
        broken = wire.ChecksumJob(wire.checksum_of, "not a buffer")
        with pytest.raises(TypeError):
            await broken.result()
        return await job.result()

    assert asyncio.run(go()) == crc32c.crc32c(data.tobytes())
    assert wire._checksum_threads is None
