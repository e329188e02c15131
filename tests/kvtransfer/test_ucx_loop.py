"""UCX progressed on the event loop (services/kvtransfer/ucx_loop.py), between two real
processes: connections keep their messages apart, a dead peer ends what waits on it, a large
message does not hold the loop, and an idle worker sleeps."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from services.kvtransfer import ucx_loop
from services.kvtransfer.ucx_setup import configure_ucx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A peer that echoes what comes on tag 1 back on tag 2, each connection on its own, and answers
# a size (int64) on tag 4 with that many bytes on tag 5; an 8-byte message on tag 3 makes it exit
# at once (a crash: no goodbye).
_ECHO = r"""
import asyncio, os
import numpy as np
from services.kvtransfer.ucx_setup import configure_ucx
configure_ucx()
from services.kvtransfer import ucx_loop

async def main():
    async def serve(ep):
        buf = np.empty(64, dtype=np.uint8)
        die = np.empty(8, dtype=np.uint8)
        dying = ep.recv(die, 3)
        dying.add_done_callback(lambda f: f.exception() is None and os._exit(9))
        sender = asyncio.ensure_future(send_large(ep))
        try:
            while True:
                await ep.recv(buf, 1)
                await ep.send(buf.copy(), 2)
        except ConnectionError:
            pass
        finally:
            sender.cancel()

    large = {}

    async def send_large(ep):
        size = np.empty(1, dtype=np.int64)
        while True:
            await ep.recv(size, 4)
            n = int(size[0])
            if n not in large:
                large[n] = np.ones(n, dtype=np.uint8)
            await ep.send(large[n], 5)
    listener = ucx_loop.worker().listen(serve)
    print(listener.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
def echo():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
    peer = subprocess.Popen(
        [sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        port = peer.stdout.readline().strip()
        assert port.isdigit(), "the echo peer did not start"
        yield peer, int(port)
    finally:
        peer.kill()
        peer.wait()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_connections_keep_their_messages_apart(echo):
    """UCX matches tags across a worker's endpoints: two connections receiving on the same tag
    at the same time must each get their own peer's answer."""
    configure_ucx()
    _, port = echo

    async def main() -> list[bytes]:
        w = ucx_loop.worker()
        a, b = await w.connect("127.0.0.1", port), await w.connect("127.0.0.1", port)
        assert a.conn_id != b.conn_id
        got_a, got_b = np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
        waits = [a.recv(got_a, 2), b.recv(got_b, 2)]  # both posted before either answer
        await b.send(np.full(64, ord("b"), dtype=np.uint8), 1)
        await a.send(np.full(64, ord("a"), dtype=np.uint8), 1)
        await asyncio.wait_for(asyncio.gather(*waits), 30)
        ucx_loop.shutdown()
        return [bytes(got_a[:3]), bytes(got_b[:3])]

    assert asyncio.run(main()) == [b"aaa", b"bbb"]


def test_a_dead_peer_ends_the_receives_waiting_on_it(echo):
    configure_ucx()
    peer, port = echo

    async def main() -> None:
        w = ucx_loop.worker()
        ep = await w.connect("127.0.0.1", port)
        waiting = ep.recv(np.empty(64, dtype=np.uint8), 2)  # never answered
        await ep.send(np.zeros(8, dtype=np.uint8), 3)  # the peer dies
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(waiting, 30)
        assert ep.closed
        with pytest.raises(ConnectionError):  # and a closed endpoint refuses at once
            await ep.send(np.zeros(8, dtype=np.uint8), 1)
        with pytest.raises(ConnectionError):  # nobody listens any more
            await asyncio.wait_for(w.connect("127.0.0.1", port), 30)
        ucx_loop.shutdown()

    asyncio.run(main())
    assert peer.wait(timeout=30) == 9


def test_a_large_message_does_not_hold_the_loop(echo):
    """UCX copies a large message a slice at a time: the loop runs its other callbacks
    meanwhile (a ticker's longest gap stays far below the copy's length; unsliced, the copy ran
    whole inside one callback)."""
    configure_ucx()
    _, port = echo
    size = 256 * 2**20

    async def main() -> tuple[float, float, np.ndarray]:
        loop = asyncio.get_running_loop()
        ep = await ucx_loop.worker().connect("127.0.0.1", port)
        dst = np.zeros(size, dtype=np.uint8)
        ask = np.array([size], dtype=np.int64)
        await ep.send(ask, 4)  # a first time: the peer allocates the message
        await asyncio.wait_for(ep.recv(dst, 5), 60)
        dst[:] = 0
        got = ep.recv(dst, 5)
        ticks: list[float] = []

        def tick() -> None:
            ticks.append(time.perf_counter())
            if not got.done():
                loop.call_soon(tick)

        await ep.send(ask, 4)
        started = time.perf_counter()
        tick()
        await asyncio.wait_for(got, 60)
        took = time.perf_counter() - started
        ucx_loop.shutdown()
        return took, float(np.diff(ticks).max()), dst

    took, longest_gap, dst = asyncio.run(main())
    assert dst.min() == 1  # all of it arrived
    assert longest_gap < took / 4, (
        f"the loop was held {longest_gap * 1e3:.1f} of {took * 1e3:.1f} ms"
    )


def test_an_idle_worker_sleeps(echo):
    """Nothing spins while a receive is posted: the loop waits on UCX's file descriptor."""
    configure_ucx()
    peer, port = echo

    async def main() -> float:
        w = ucx_loop.worker()
        ep = await w.connect("127.0.0.1", port)
        back = np.empty(64, dtype=np.uint8)
        await ep.send(np.ones(64, dtype=np.uint8), 1)
        await asyncio.wait_for(ep.recv(back, 2), 30)  # connected both ways
        waiting = ep.recv(np.empty(64, dtype=np.uint8), 2)  # posted, never answered
        before, mine = _cpu_s(peer.pid), _cpu_s(os.getpid())
        await asyncio.sleep(2.0)
        used = (_cpu_s(peer.pid) - before) + (_cpu_s(os.getpid()) - mine)
        assert not waiting.done()
        ucx_loop.shutdown()
        return used

    started = time.monotonic()
    used = asyncio.run(main())
    # A spinning wait would take ~2 s of CPU on each side; sleeping ones take next to none.
    assert used < 0.4, f"{used:.2f} s of CPU in 2 s idle (elapsed {time.monotonic() - started:.1f})"


def test_a_lane_receives_on_its_own_thread_and_sleeps_when_idle(echo):
    """A lane's copies run on its thread, which runs a receive's `then` there too (its result
    is the future's); idle, the thread sleeps; shutting down stops it."""
    configure_ucx()
    peer, port = echo
    size = 16 * 2**20

    async def main() -> tuple:
        lane = ucx_loop.worker(lane=1)
        assert lane is not ucx_loop.worker() and lane is ucx_loop.worker(lane=1)
        ep = await lane.connect("127.0.0.1", port)
        dst = np.zeros(size, dtype=np.uint8)
        got = ep.recv(dst, 5, then=lambda b: (threading.current_thread().name, int(b.sum())))
        await ep.send(np.array([size], dtype=np.int64), 4)
        copied_on, total = await asyncio.wait_for(got, 60)
        waiting = ep.recv(np.empty(64, dtype=np.uint8), 2)  # posted, never answered
        before, mine = _cpu_s(peer.pid), _cpu_s(os.getpid())
        await asyncio.sleep(1.0)
        idle_cpu = (_cpu_s(peer.pid) - before) + (_cpu_s(os.getpid()) - mine)
        assert not waiting.done()
        thread = lane._thread
        ucx_loop.shutdown()
        return copied_on, total, idle_cpu, thread.is_alive()

    copied_on, total, idle_cpu, alive = asyncio.run(main())
    assert (copied_on, total) == ("ucx-lane-1", size)
    assert idle_cpu < 0.2, f"{idle_cpu:.2f} s of CPU in 1 s idle"
    assert not alive


def test_a_lane_connecting_to_a_dead_peer_fails_at_once(echo):
    """A lane's thread may see a connection fail while the loop makes its first requests: they
    are made under the lane's lock, so a failed endpoint is never sent on (a stream send on one
    spun inside UCX for good, holding the worker: a pull hung past every timeout)."""
    configure_ucx()
    peer, port = echo

    async def main() -> None:
        lane = ucx_loop.worker(lane=1)
        ep = await lane.connect("127.0.0.1", port)
        await ep.send(np.zeros(8, dtype=np.uint8), 3)  # the peer dies
        for _ in range(20):
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(lane.connect("127.0.0.1", port), 30)
        ucx_loop.shutdown()

    asyncio.run(main())
    assert peer.wait(timeout=30) == 9


@pytest.mark.parametrize("lane", [0, 1])
def test_aborting_an_endpoint_ends_the_receives_posted_on_it(echo, lane):
    """A receive whose message never came ends, with an error, when its endpoint is aborted:
    UCX matches tags per worker and left it posted, its buffer referenced, where a late message
    of the old connection could still land. Other connections' receives are not touched."""
    configure_ucx()
    _, port = echo

    async def main() -> None:
        w = ucx_loop.worker(lane)
        ep, other = await w.connect("127.0.0.1", port), await w.connect("127.0.0.1", port)
        waiting = ep.recv(np.empty(64, dtype=np.uint8), 2)  # never answered
        untouched = other.recv(np.empty(64, dtype=np.uint8), 2)
        await asyncio.sleep(0.1)
        ep.abort()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(waiting, 10)
        assert not untouched.done()
        await other.send(np.full(64, 7, dtype=np.uint8), 1)  # the echo answers this one
        await asyncio.wait_for(untouched, 10)
        assert len(w._pending) == 0  # nothing left referenced
        ucx_loop.shutdown()

    asyncio.run(main())
