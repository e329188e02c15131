"""UCX progressed on the event loop (services/kvtransfer/ucx_loop.py), between two real
processes: connections keep their messages apart, a dead peer ends what waits on it, and an
idle worker sleeps."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from services.kvtransfer import ucx_loop
from services.kvtransfer.transports import configure_ucx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A peer that echoes what comes on tag 1 back on tag 2, each connection on its own; an 8-byte
# message on tag 3 makes it exit at once (a crash: no goodbye).
_ECHO = r"""
import asyncio, os
import numpy as np
from services.kvtransfer.transports import configure_ucx
configure_ucx()
from services.kvtransfer import ucx_loop

async def main():
    async def serve(ep):
        buf = np.empty(64, dtype=np.uint8)
        die = np.empty(8, dtype=np.uint8)
        dying = ep.recv(die, 3)
        dying.add_done_callback(lambda f: f.exception() is None and os._exit(9))
        try:
            while True:
                await ep.recv(buf, 1)
                await ep.send(buf.copy(), 2)
        except ConnectionError:
            pass
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
