"""How load and prefix-cache events reach every gateway: the cost per event delivered, at
WORKERS workers x GATEWAYS gateways, of the two ways the mesh could carry them.

* `stream` (what the mesh does): each worker serves its WorkerLoadFeed (services/worker/
  announcer.py `LoadFeed`, the real one) and every gateway subscribes to every worker it finds in
  etcd (services/gateway/membership.py `Membership`, the real one, into a real `Registry`).
* `etcd`: each worker puts its report (the same LoadReport bytes) under a lease-backed key every
  interval, and every gateway watches the prefix (etcd's v3 Watch), applying each to a
  `Registry` the same way.

Workers are **emulated**: one process runs all of them, each with a real PrefixCacheLog fed
EVENTS stored and EVENTS evicted block hashes per report interval (a busy prefix cache), and a
load whose `decode_step_ms` field carries the report's wall-clock time (this bench only) so each
gateway measures delivery latency. Gateways are GATEWAYS processes. Cost: CPU seconds of every
process involved (workers, gateways, and etcd for `etcd`; etcd's membership traffic for
`stream` is a few lease renewals) over the measured window, per event delivered (one report to
one gateway), beside the delivery latency p50/p99.

Prints a table and one JSON line. About 1 minute on 2 cores.

    .venv/bin/python bench/gateways/events.py [--workers 64] [--gateways 8] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.procfs import cpu_seconds, descendants
from distserve.loadgen.report import host, log, percentiles

LOAD_PREFIX = b"/bench/load/"


def _report_load(i: int):
    from services.common.gen.distserve.v1 import common_pb2

    return common_pb2.WorkerLoad(
        kv_block_size=16, total_kv_blocks=4096, free_kv_blocks=1000 + i, decode_step_ms=time.time()
    )


async def workers(mode: str, etcd: str, n: int, interval_s: float, events: int) -> None:
    """`n` emulated workers in this process."""
    import grpc
    from aetcd import rpc

    from services.common.discovery import Member
    from services.common.etcd_client import EtcdConfig, etcd_target
    from services.worker.announcer import Announcer, LoadFeed
    from services.worker.prefix_log import PrefixCacheLog

    logs = [PrefixCacheLog(b"salt", max_events=4 * events) for _ in range(n)]

    async def churn() -> None:  # the prefix caches store and evict every interval
        while True:
            for log_ in logs:
                held = list(log_._held)
                removed = random.sample(held, min(events, len(held)))
                log_.record(False, [random.getrandbits(63) for _ in range(events)], removed)
            await asyncio.sleep(interval_s)

    tasks = [asyncio.create_task(churn())]
    kept: list = []
    if mode == "stream":
        for i in range(n):
            feed = LoadFeed(lambda i=i: _report_load(i), logs[i], interval_s)
            server = grpc.aio.server()
            feed.add_to(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            feed.start()
            member = Member(f"w{i}", "decode", f"127.0.0.1:{port}", total_kv_blocks=4096)
            announcer = Announcer(EtcdConfig.parse(etcd), member)
            await announcer.start()
            kept.append((server, feed, announcer))  # a server nothing refers to is collected
    else:
        kv = rpc.KVStub(grpc.aio.insecure_channel(etcd_target(etcd)))
        lease = rpc.LeaseStub(grpc.aio.insecure_channel(etcd_target(etcd)))
        grant = await lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=60))

        async def put(i: int) -> None:
            from services.common.gen.distserve.v1 import gateway_pb2

            first = True
            while True:
                cache = logs[i].whole() if first else logs[i].report()
                report = gateway_pb2.LoadReport(load=_report_load(i), prefix_cache=cache)
                key = LOAD_PREFIX + f"w{i}".encode()
                value = report.SerializeToString()
                await kv.Put(rpc.PutRequest(key=key, value=value, lease=grant.ID))
                first = False
                await asyncio.sleep(interval_s)

        for i in range(n):
            tasks.append(asyncio.create_task(put(i)))
    print("ready", flush=True)
    await asyncio.Event().wait()


async def gateway(mode: str, etcd: str, workers: int) -> None:
    """One gateway's view; says ready once it hears from all `workers`, then prints its count
    of events delivered and their latencies on SIGUSR1 (the window's start) and SIGUSR2 (its
    end)."""
    import grpc
    from aetcd import rpc

    from services.common.discovery import EtcdDiscovery
    from services.common.etcd_client import EtcdConfig, etcd_target
    from services.common.gen.distserve.v1 import gateway_pb2
    from services.gateway.membership import Membership, load_of
    from services.gateway.registry import Registry

    registry = Registry(lease_s=60)
    latencies: list[float] = []
    count = [0]
    original = registry.report

    def report(worker_id, load, events=None, address=None) -> bool:
        count[0] += 1
        latencies.append(time.time() - load.decode_step_ms)
        return original(worker_id, load, events, address)

    registry.report = report
    loop = asyncio.get_running_loop()
    marks: list[int] = []

    def mark() -> None:
        marks.append(count[0])
        if len(marks) == 1:
            latencies.clear()
        else:
            ms = [x * 1000 for x in latencies]
            seen = len(registry.live())
            out = {"events": marks[1] - marks[0], "latency_ms": ms, "workers_seen": seen}
            print(json.dumps(out), flush=True)

    loop.add_signal_handler(signal.SIGUSR1, mark)
    loop.add_signal_handler(signal.SIGUSR2, mark)
    if mode == "stream":
        channels: dict[str, grpc.aio.Channel] = {}

        def channel(address: str) -> grpc.aio.Channel:
            return channels.setdefault(address, grpc.aio.insecure_channel(address))

        Membership(registry, EtcdDiscovery(EtcdConfig.parse(etcd)), channel).start()
        while len(registry.live()) < workers:
            await asyncio.sleep(0.05)
        print("ready", flush=True)
    else:
        from services.gateway.prefix_index import CachedBlocks
        from services.gateway.registry import Load

        watch = rpc.WatchStub(grpc.aio.insecure_channel(etcd_target(etcd)))
        call = watch.Watch()
        end = LOAD_PREFIX[:-1] + bytes([LOAD_PREFIX[-1] + 1])
        create = rpc.WatchCreateRequest(key=LOAD_PREFIX, range_end=end)
        await call.write(rpc.WatchRequest(create_request=create))
        print("ready", flush=True)  # hears every put from now on
        async for reply in call:
            for event in reply.events:
                worker_id = event.kv.key[len(LOAD_PREFIX) :].decode()
                if worker_id not in registry:
                    registry.register(worker_id, "decode", "-", Load(), CachedBlocks(b"salt"))
                r = gateway_pb2.LoadReport.FromString(event.kv.value)
                c = r.prefix_cache
                registry.report(worker_id, load_of(r.load), (c.reset, c.stored, c.removed))
    await asyncio.Event().wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--gateways", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--interval-s", type=float, default=0.5, help="report interval (the mesh's)")
    p.add_argument("--events", type=int, default=16, help="blocks stored and evicted per report")
    p.add_argument("--modes", default="stream,etcd")
    p.add_argument("--role", choices=("workers", "gateway"), help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--etcd", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "workers":
        asyncio.run(workers(a.mode, a.etcd, a.workers, a.interval_s, a.events))
        return 0
    if a.role == "gateway":
        asyncio.run(gateway(a.mode, a.etcd, a.workers))
        return 0
    from distserve.etcd import Etcd

    results = {}
    for mode in a.modes.split(","):
        with Etcd() as etcd:
            results[mode] = _run(mode, etcd, a)
    log(f"{a.workers} emulated workers x {a.gateways} gateways, a report every {a.interval_s} s")
    log(
        f"{'mode':8} {'events/s':>9} {'CPU us/event':>13} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'CPU s: workers':>15} {'gateways':>9} {'etcd':>6}"
    )
    for mode, r in results.items():
        log(
            f"{mode:8} {r['events_per_s']:9.0f} {r['cpu_us_per_event']:13.1f} "
            f"{r['latency_ms_p50']:7.1f} {r['latency_ms_p99']:7.1f} "
            f"{r['workers_cpu_s']:15.2f} {r['gateways_cpu_s']:9.2f} {r['etcd_cpu_s']:6.2f}"
        )
    print(
        json.dumps(
            {
                "bench": "gateway_events",
                "engine": "emulated workers",
                "workers": a.workers,
                "gateways": a.gateways,
                "interval_s": a.interval_s,
                "events_per_report": a.events,
                "host": host(),
                **{f"{mode}_{k}": v for mode, r in results.items() for k, v in r.items()},
            }
        )
    )
    return 0


def _run(mode: str, etcd, a: argparse.Namespace) -> dict:
    me = [sys.executable, __file__, "--mode", mode, "--etcd", etcd.url]
    args = ["--workers", str(a.workers), "--interval-s", str(a.interval_s)]
    procs = [
        subprocess.Popen(
            [*me, "--role", "workers", *args, "--events", str(a.events)],
            stdout=subprocess.PIPE,
            text=True,
        )
    ]
    try:
        assert procs[0].stdout.readline().strip() == "ready"
        gateways = [
            subprocess.Popen([*me, "--role", "gateway", *args], stdout=subprocess.PIPE, text=True)
            for _ in range(a.gateways)
        ]
        procs += gateways
        for g in gateways:
            assert g.stdout.readline().strip() == "ready"
        time.sleep(2.0)  # past the subscriptions' first (whole) reports
        etcd_pid = descendants(etcd.popen.pid)[0]  # etcd, under its keeper
        pids = [p.pid for p in procs] + [etcd_pid]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        for g in gateways:
            g.send_signal(signal.SIGUSR1)
        t0 = time.monotonic()
        time.sleep(a.seconds)
        for g in gateways:
            g.send_signal(signal.SIGUSR2)
        window = time.monotonic() - t0
        spent = [cpu_seconds(pid) - c0 for pid, c0 in zip(pids, cpu0, strict=True)]
        cpu, workers_cpu, etcd_cpu = sum(spent), spent[0], spent[-1]
        seen = [json.loads(g.stdout.readline()) for g in gateways]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    events = sum(s["events"] for s in seen)
    if any(s["workers_seen"] != a.workers for s in seen):
        log(f"{mode}: workers seen by each gateway: {[s['workers_seen'] for s in seen]}")
    latency = [x for s in seen for x in s["latency_ms"]]
    pct = percentiles(latency, (50, 99), ndigits=1)
    return {
        "events_per_s": round(events / window, 1),
        "cpu_us_per_event": round(cpu / max(1, events) * 1e6, 1),
        "workers_cpu_s": round(workers_cpu, 2),
        "gateways_cpu_s": round(cpu - workers_cpu - etcd_cpu, 2),
        "etcd_cpu_s": round(etcd_cpu, 2),
        "cpu_s": round(cpu, 2),
        "latency_ms_p50": pct["p50"],
        "latency_ms_p99": pct["p99"],
    }


if __name__ == "__main__":
    raise SystemExit(main())
