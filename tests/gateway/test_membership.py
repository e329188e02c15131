"""Membership through a real etcd (started by the test) and load feeds over real gRPC: two
gateways' views (each a Registry kept by the gateway's own Membership) see the same workers, the
same load and the same prefix-cache events; a SIGKILLed worker leaves both within its lease's
TTL; with etcd gone, both keep routing on their last view."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest

from distserve.etcd import Etcd
from services.common.discovery import EtcdDiscovery, Member
from services.common.etcd_client import EtcdConfig
from services.common.gen.distserve.v1 import common_pb2
from services.common.prefix_hash import block_hashes, cache_salt
from services.gateway.membership import Membership
from services.gateway.prefix_index import PromptBlocks
from services.gateway.registry import Registry
from services.gateway.routing import Routing
from services.worker.announcer import Announcer, LoadFeed
from services.worker.prefix_log import PrefixCacheLog

SALT = cache_salt("model-a", "float32")
BS = 4
SYSTEM = list(range(100, 132))
PROMPT = [*SYSTEM, 7, 8, 9, 10, 11, 12]
TTL_S = 2.0  # etcd's shortest lease at its default election timeout

# A worker in its own process: a load feed on a gRPC server, its entry in etcd under a lease.
WORKER = """
import asyncio, sys
import grpc
from services.common.discovery import Member
from services.common.gen.distserve.v1 import common_pb2
from services.common.etcd_client import EtcdConfig
from services.worker.announcer import Announcer, LoadFeed

async def main():
    feed = LoadFeed(lambda: common_pb2.WorkerLoad(kv_block_size=16, total_kv_blocks=8))
    server = grpc.aio.server()
    feed.add_to(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    feed.start()
    member = Member("w", "decode", f"127.0.0.1:{port}", total_kv_blocks=8)
    await Announcer(EtcdConfig.parse(sys.argv[1]), member, ttl_s=float(sys.argv[2])).start()
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.fixture
def etcd():
    with Etcd() as e:
        yield e


def _gateway(url: str) -> tuple[Registry, Membership]:
    registry = Registry(lease_s=60)
    channels: dict[str, grpc.aio.Channel] = {}

    def channel(address: str) -> grpc.aio.Channel:
        return channels.setdefault(address, grpc.aio.insecure_channel(address))

    discovery = EtcdDiscovery(EtcdConfig.parse(url))
    return registry, Membership(registry, discovery, channel, retry_s=0.1)


async def _until(check, timeout_s: float = 10.0, what: str = "") -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_two_gateways_see_the_same_workers_load_and_prefix_events(etcd):
    asyncio.run(_same_view(etcd.url))


async def _same_view(url: str) -> None:
    logs = {name: PrefixCacheLog(SALT) for name in ("p0", "p1")}
    queued = {"p0": 0, "p1": 0}
    servers, announcers = [], []
    gateways = [_gateway(url) for _ in range(2)]
    for _, membership in gateways:
        membership.start()
    try:
        for name, log in logs.items():

            def load(name=name) -> common_pb2.WorkerLoad:
                return common_pb2.WorkerLoad(
                    kv_block_size=BS, total_kv_blocks=64, queued_prompt_tokens=queued[name]
                )

            feed = LoadFeed(load, log, interval_s=0.05)
            server = grpc.aio.server()
            feed.add_to(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            feed.start()
            servers.append((server, feed))
            member = Member(
                name, "prefill", f"127.0.0.1:{port}", kv_block_size=BS, prefix_cache_salt=SALT
            )
            announcer = Announcer(EtcdConfig.parse(url), member)
            await announcer.start()
            announcers.append(announcer)

        def picks() -> list[str]:
            return [
                Routing(r).pick_prefill(prompt=PromptBlocks(PROMPT)).worker_id for r, _ in gateways
            ]

        await _until(lambda: all(len(r.live()) == 2 for r, _ in gateways), what="both see both")
        assert picks() == ["p0", "p0"]
        logs["p1"].record(False, block_hashes(SYSTEM, BS, SALT), [])  # p1 caches the prefix
        await _until(lambda: picks() == ["p1", "p1"], what="both route to the cached prefix")
        logs["p1"].record(False, [], block_hashes(SYSTEM, BS, SALT)[:1])  # its first block evicted
        await _until(lambda: picks() == ["p0", "p0"], what="both see the eviction")
        queued["p0"] = 500  # load reaches both as well
        await _until(
            lambda: all(r._workers["p0"].queued_tokens == 500 for r, _ in gateways), what="load"
        )
        # p1 drains: it deregisters, and leaves both views at once.
        await announcers.pop().stop()
        await _until(lambda: all("p1" not in r for r, _ in gateways), timeout_s=2, what="p1 left")
        # A gateway that starts now gets the whole prefix cache of p0 on subscribing.
        logs["p0"].record(False, block_hashes(SYSTEM, BS, SALT), [])
        late, membership = _gateway(url)
        membership.start()
        gateways.append((late, membership))
        await _until(lambda: late._workers.get("p0") and late.live(), what="the late one sees p0")
        await _until(
            lambda: late._workers["p0"].cache.prefix_blocks(block_hashes(PROMPT, BS, SALT)) == 8,
            what="the late one has p0's whole cache",
        )
    finally:
        for a in announcers:
            await a.stop()
        for _, membership in gateways:
            await membership.stop()
        for server, feed in servers:
            await feed.stop()
            await server.stop(None)


def test_a_killed_worker_leaves_every_gateway_within_its_ttl(etcd):
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, etcd.url, str(TTL_S)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout.readline().strip() == "ready"
        asyncio.run(_killed_leaves(etcd.url, worker))
    finally:
        worker.kill()
        worker.wait()


async def _killed_leaves(url: str, worker: subprocess.Popen) -> None:
    gateways = [_gateway(url) for _ in range(2)]
    for _, membership in gateways:
        membership.start()
    try:
        await _until(lambda: all(r.live() for r, _ in gateways), what="both see the worker")
        worker.send_signal(signal.SIGKILL)
        # Its feed breaks at once: not routed to from then on ...
        await _until(lambda: not any(r.live() for r, _ in gateways), timeout_s=2, what="suspended")
        # ... and its lease lapses: etcd deletes its entry, and it leaves both views.
        took = await _until(
            lambda: all("w" not in r for r, _ in gateways), timeout_s=TTL_S + 2, what="left"
        )
        assert took <= TTL_S + 1.0
    finally:
        for _, membership in gateways:
            await membership.stop()


def test_with_etcd_gone_gateways_keep_their_last_view(etcd):
    asyncio.run(_etcd_gone(etcd))


async def _etcd_gone(etcd: Etcd) -> None:
    server = grpc.aio.server()
    feed = LoadFeed(lambda: common_pb2.WorkerLoad(kv_block_size=16, total_kv_blocks=8), None, 0.05)
    feed.add_to(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    feed.start()
    announcer = Announcer(etcd.config, Member("d", "decode", f"127.0.0.1:{port}"))
    await announcer.start()
    registry, membership = _gateway(etcd.url)
    membership.start()
    try:
        await _until(lambda: registry.live(), what="the worker is seen")
        etcd.kill()
        await asyncio.sleep(TTL_S * 2)  # past its lease, which nobody can renew or expire now
        assert [w.worker_id for w in registry.live("decode")] == ["d"]
    finally:
        announcer._task.cancel()
        await announcer.discovery.close()
        await membership.stop()
        await feed.stop()
        await server.stop(None)
