"""The planner leads once: replicas elect one leader on a real etcd (started by the test); a
resigning leader hands over at once, one cut off from etcd stops leading within its lease's TTL,
and a SIGKILLed planner process is replaced within a TTL, with only the leader ever asking its
actuator anything. And the planner's feed: two gateways' feeds into one planner are summed, each
sample counted once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from prometheus_client import CollectorRegistry

from distserve.etcd import Etcd
from services.common import clock
from services.common.election import Election
from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.gateway.planner_feed import PlannerFeed
from services.planner.__main__ import control_loop, parse
from services.planner.drift import Arrival
from services.planner.metrics import PlannerMetrics
from services.planner.replanner import Replanner
from services.planner.servicer import PlannerServicer
from services.planner.surge import arrival_rate
from tests.gateway.test_membership import _until

TTL_S = 2.0  # etcd's shortest lease at its default election timeout
EXPIRY_SLACK_S = 0.6  # etcd looks for lapsed leases every 500 ms; then the watch's delivery


@pytest.fixture
def etcd():
    with Etcd() as e:
        yield e


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_one_of_three_leads_and_a_resigning_leader_hands_over_at_once(etcd):
    async def main() -> None:
        elections = [Election(etcd.config, "planner", f"replica-{i}", TTL_S) for i in range(3)]
        tasks = [asyncio.create_task(e.run()) for e in elections]
        try:
            await _until(lambda: any(e.leading for e in elections), 10, "a leader")
            await asyncio.sleep(1.5 * TTL_S)  # renewals go on: still the same one, alone
            leaders = [e for e in elections if e.leading]
            assert len(leaders) == 1
            first = leaders[0]
            await _until(
                lambda: all(e.leader == first.value for e in elections), TTL_S + 1, "all see it"
            )
            i = elections.index(first)
            await _stop(tasks[i])  # resigns: revokes its lease
            rest = elections[:i] + elections[i + 1 :]
            took = await _until(lambda: any(e.leading for e in rest), TTL_S, "a new leader")
            assert took < 1.0, f"a resignation hands over at once, not after a TTL: {took:.2f} s"
            await asyncio.sleep(0.5)
            assert sum(e.leading for e in rest) == 1 and not first.leading
        finally:
            for task in tasks:
                await _stop(task)
            for e in elections:
                await e.close()

    asyncio.run(main())


def test_a_leader_cut_off_from_etcd_stops_leading_within_its_ttl(etcd):
    async def main() -> None:
        election = Election(etcd.config, "planner", "alone", TTL_S, retry_s=0.1)
        task = asyncio.create_task(election.run())
        try:
            await _until(lambda: election.leading, 10, "leading")
            killed = time.monotonic()
            etcd.kill()
            await _until(lambda: not election.leading, TTL_S + 5, "stepping down")
            # Its lease lapses on etcd no earlier than the TTL after its last renewal, sent
            # before the kill: it leads until no later than that (whenever this loop gets to
            # look), so a standby never leads beside it.
            after = election.lease_deadline - killed
            assert after <= TTL_S, f"led until {after:.2f} s after etcd went"
        finally:
            await _stop(task)
            await election.close()

    asyncio.run(main())


class CountingActuator(planner_pb2_grpc.ActuatorServicer):
    """An Actuator service that answers a steady 1P1D mesh and counts who asks."""

    def __init__(self) -> None:
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        planner_pb2_grpc.add_ActuatorServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Status(self, request, context):
        self.calls += 1
        return planner_pb2.ActuatorStatus(
            instances=[
                planner_pb2.ActuatorInstance(name="prefill-0", role="prefill", state="serving"),
                planner_pb2.ActuatorInstance(name="decode-0", role="decode", state="serving"),
            ]
        )

    def Apply(self, request, context):
        self.calls += 1
        return planner_pb2.ApplyResponse()


def _leader_gauge(metrics_address: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("distserve_planner_leader "):
                return float(line.split()[1])
    raise AssertionError("no distserve_planner_leader gauge")


def _planner(etcd_url: str, actuator: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "services.planner", "--etcd", etcd_url,
            "--election-ttl-s", str(TTL_S), "--budget", "4", "--actuator", actuator,
            "--model-spec", "opt-13b", "--slo", "250,100", "--decide-every-s", "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    ready = json.loads(proc.stdout.readline())
    assert ready["event"] == "ready", ready
    return proc, ready


def test_a_sigkilled_leader_planner_is_replaced_within_a_ttl_and_only_the_leader_acts(etcd):
    actuators = [CountingActuator(), CountingActuator()]
    procs = []
    try:
        for a in actuators:
            procs.append(_planner(etcd.url, a.address))
        gauges = lambda: [_leader_gauge(r["metrics_address"]) for _, r in procs]  # noqa: E731
        deadline = time.monotonic() + 30
        while sorted(gauges()) != [0.0, 1.0]:
            assert time.monotonic() < deadline, f"no single leader: {gauges()}"
            time.sleep(0.05)
        lead = gauges().index(1.0)
        standby = 1 - lead
        before = actuators[standby].calls
        time.sleep(1.5)  # several decision intervals
        assert actuators[lead].calls > 0, "the leader decides (it asks its actuator)"
        assert actuators[standby].calls == before == 0, "a standby asks nothing"
        channel = grpc.insecure_channel(procs[standby][1]["address"])
        with channel, pytest.raises(grpc.RpcError) as refused:
            planner_pb2_grpc.PlannerStub(channel).GetDecision(
                planner_pb2.GetDecisionRequest(), timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert procs[lead][1]["address"] in refused.value.details()

        procs[lead][0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while _leader_gauge(procs[standby][1]["metrics_address"]) != 1.0:
            assert time.monotonic() - killed < TTL_S + 5, "the standby never took over"
            time.sleep(0.02)
        took = time.monotonic() - killed
        print(f"takeover {took:.2f} s after SIGKILL (lease TTL {TTL_S:g} s)")
        assert took <= TTL_S + EXPIRY_SLACK_S, f"took over {took:.2f} s after the kill"
        calls = actuators[standby].calls
        time.sleep(1.0)
        assert actuators[standby].calls > calls, "the new leader decides"
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait(timeout=10)
        for a in actuators:
            a.server.stop(0)


def test_the_planners_workload_sums_two_gateways_and_counts_each_sample_once():
    config = parse(
        [
            "--budget", "4", "--actuator", "127.0.0.1:9", "--model-spec", "opt-13b",
            "--slo", "250,100", "--window-s", "600", "--drift-window", "1000",
        ]
    )  # fmt: skip
    arrivals = {0: 30, 1: 50}  # per gateway
    finishes = {0: 7, 1: 11}

    async def main() -> None:
        metrics = PlannerMetrics(CollectorRegistry())
        control = control_loop(config, metrics.registry)
        servicer = PlannerServicer(config, Replanner(config.drift), metrics, control)
        server = grpc.aio.server()
        planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        since = clock.time_s()
        feeds = [
            PlannerFeed(f"127.0.0.1:{port}", CollectorRegistry(), stream_samples=8, stream_s=0.2)
            for _ in arrivals
        ]
        sent: dict[int, list[float]] = {g: [] for g in arrivals}
        try:
            for feed in feeds:
                feed.start()
            for i in range(max(arrivals.values())):  # the two gateways' requests interleave
                for g, feed in enumerate(feeds):
                    if i < arrivals[g]:
                        sent[g].append(clock.time_s())
                        feed.arrived(sent[g][-1], 100)
                    if i < finishes[g]:
                        feed.add(sent[g][i], 100, 20, 0.05, 0.02)
                await asyncio.sleep(0.01)
            total = sum(arrivals.values())
            await _until(lambda: len(control.arrivals) >= total, 20, "every arrival")
            await asyncio.sleep(0.5)  # anything sent twice would have landed by now
        finally:
            for feed in feeds:
                await feed.stop()
            await server.stop(0)
        assert sorted(a.arrival_s for a in control.arrivals) == sorted(sent[0] + sent[1])
        assert {a.prompt_tokens for a in control.arrivals} == {100}  # the length at arrival
        assert len(control.samples) == sum(finishes.values())
        assert metrics.samples._value.get() == sum(finishes.values())
        now = clock.time_s()
        window = config.autoscale.config.window_s
        surge = config.autoscale.config.surge
        times = [a.arrival_s for a in control.arrivals]
        measured, _ = arrival_rate(times, now, since, window, surge)
        each = [arrival_rate(sent[g], now, since, window, surge)[0] for g in arrivals]
        assert measured == pytest.approx(sum(each), rel=1e-9)

    asyncio.run(main())


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--etcd", "https://etcd:2379"], "--etcd"),
        (["--etcd", "http://etcd:2379", "--election-ttl-s", "1"], "--election-ttl-s"),
        (["--etcd", "http://etcd:2379", "--election-key", "a/b"], "--election-key"),
        (["--advertise", "planner-0.planner:50052"], "--advertise .*give --etcd"),
        (["--etcd", "http://etcd:2379", "--advertise", "planner-0"], "--advertise takes HOST:PORT"),
    ],
)
def test_bad_election_flags_are_refused_by_name(argv, named):
    with pytest.raises(InvalidRequest, match=named):
        parse(argv)


def test_one_gateway_reports_every_sample_to_each_planner_replica():
    """`--planner A,B`: the leader and the standby both hold the whole workload, so a standby
    that takes over decides on a full window."""
    config = parse(
        [
            "--budget", "4", "--actuator", "127.0.0.1:9", "--model-spec", "opt-13b",
            "--slo", "250,100", "--window-s", "600", "--drift-window", "1000",
        ]
    )  # fmt: skip

    async def main() -> None:
        controls, servers, ports = [], [], []
        for _ in range(2):
            metrics = PlannerMetrics(CollectorRegistry())
            control = control_loop(config, metrics.registry)
            servicer = PlannerServicer(config, Replanner(config.drift), metrics, control)
            server = grpc.aio.server()
            planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)
            ports.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            controls.append(control)
            servers.append(server)
        registry = CollectorRegistry()
        addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
        feed = PlannerFeed(addresses, registry, stream_samples=8, stream_s=0.2)
        sent = []
        try:
            feed.start()
            for i in range(40):
                sent.append(clock.time_s())
                feed.arrived(sent[-1], 100)
                if i % 4 == 0:
                    feed.add(sent[-1], 100, 20, 0.05, 0.02)
                await asyncio.sleep(0.005)
            for c in controls:
                await _until(lambda c=c: len(c.arrivals) >= len(sent), 20, "every arrival")
            await asyncio.sleep(0.5)  # anything sent twice would have landed by now
        finally:
            await feed.stop()
            for server in servers:
                await server.stop(0)
        for c in controls:
            assert sorted(c.arrivals) == sorted(Arrival(t, 100) for t in sent)
            assert len(c.samples) == 10
        value = registry.get_sample_value("distserve_planner_samples_total", {"outcome": "sent"})
        assert value == 2 * (len(sent) + 10)  # each sample, once to each replica

    asyncio.run(main())
