"""`--health-port`: grpc.health.v1 alone, in plaintext, beside a main server that speaks the
mesh's mutual TLS (what Kubernetes' gRPC probe, which speaks no TLS, reaches). Real processes
over real sockets, with a CA and a mesh certificate made in the test."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common import mesh_tls
from services.common.gen.distserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    planner_pb2,
    planner_pb2_grpc,
    prefill_pb2_grpc,
)
from tests.certs import mesh_pki

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TARGET = (("grpc.ssl_target_name_override", mesh_tls.SERVER_NAME),)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return mesh_pki(tmp_path_factory.mktemp("pki"))


def _env(pki) -> dict[str, str]:
    cert, key, ca = (str(p) for p in pki)
    tls = {mesh_tls.ENV_CERT: cert, mesh_tls.ENV_KEY: key, mesh_tls.ENV_CA: ca}
    return {**os.environ, **tls, "OTEL_SDK_DISABLED": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(module: str, args: list[str], pki) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--host", "127.0.0.1", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(pki),
    )


def _ready(proc: subprocess.Popen, timeout_s: float = 120.0) -> dict:
    """The process's JSON ready line (other stdout lines skipped)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, f"exited with {proc.returncode} before it was ready"
            continue
        if line.startswith("{") and json.loads(line).get("event") == "ready":
            return json.loads(line)
    raise TimeoutError("no ready line")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _check(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def _mesh_channel(address: str, pki) -> grpc.Channel:
    cert, key, ca = (p.read_bytes() for p in pki)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), TARGET)


def _assert_only_health(health_address: str, other_rpc) -> None:
    """On the plaintext port: the health service, and nothing else (not reflection, not the
    service's own methods)."""
    with grpc.insecure_channel(health_address) as channel:
        assert _code(lambda: other_rpc(channel)) == grpc.StatusCode.UNIMPLEMENTED
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        list_services = reflection_pb2.ServerReflectionRequest(list_services="")
        assert (
            _code(lambda: list(reflection.ServerReflectionInfo(iter([list_services]), timeout=5)))
            == grpc.StatusCode.UNIMPLEMENTED
        )


def _assert_not_serving_once_draining(proc: subprocess.Popen, health_address: str) -> None:
    """A Watch held open sees SERVING, then NOT_SERVING as soon as SIGTERM starts the drain."""
    with grpc.insecure_channel(health_address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=60
        )
        assert next(watch).status == SERVING
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
    assert proc.wait(timeout=60) == 0


def test_a_worker_under_mesh_tls_is_serving_on_its_health_port_only_with_model_and_kv(
    tiny_model, pki
):
    port, health_port = _free_port(), _free_port()
    args = ["--model", str(tiny_model), "--port", str(port), "--health-port", str(health_port)]
    proc = _start("services.prefill", [*args, "--metrics-port", "-1", "--no-ucx"], pki)
    seen: list[int] = []  # the health port's answers, from the process's start on
    main_at_first_serving: list = []  # the mTLS port's answer when SERVING first showed
    stop = threading.Event()

    def poll() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            while not stop.is_set() and proc.poll() is None:
                try:
                    status = _check(channel)
                except grpc.RpcError:
                    time.sleep(0.01)  # not listening yet
                    continue
                if status == SERVING and not main_at_first_serving:
                    with _mesh_channel(f"127.0.0.1:{port}", pki) as main:
                        try:
                            main_at_first_serving.append(_check(main))
                        except grpc.RpcError as e:
                            main_at_first_serving.append(e.code())
                seen.append(status)
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        ready = _ready(proc)
        assert ready["kv_capacity_tokens"] > 0  # its model and KV pool are built
        assert ready["health_address"] == f"127.0.0.1:{health_port}"
        time.sleep(0.2)
        stop.set()
        poller.join(timeout=10)
        # NOT_SERVING while it loaded the model and built its KV pool, then SERVING for good,
        # first seen when the main (mTLS) server already served: it listens only once both
        # exist.
        assert seen and seen[0] == NOT_SERVING, seen[:5]
        first = seen.index(SERVING)
        assert set(seen[:first]) == {NOT_SERVING} and set(seen[first:]) == {SERVING}
        assert main_at_first_serving == [SERVING]
        health = f"127.0.0.1:{health_port}"
        with grpc.insecure_channel(health) as channel:
            assert _check(channel, "distserve.v1.Prefill") == SERVING
        # The main port speaks mTLS only: a plaintext caller gets nothing from it.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert _code(lambda: _check(channel)) == grpc.StatusCode.UNAVAILABLE
        _assert_only_health(
            health,
            lambda c: prefill_pb2_grpc.PrefillStub(c).Stats(common_pb2.StatsRequest(), timeout=5),
        )
        _assert_not_serving_once_draining(proc, health)
    finally:
        stop.set()
        _stop(proc)


def _generate(channel: grpc.Channel) -> None:
    request = gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams())
    list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=5))


def _get_placement(channel: grpc.Channel) -> None:
    planner_pb2_grpc.PlannerStub(channel).GetPlacement(planner_pb2.GetPlacementRequest(), timeout=5)


@pytest.mark.parametrize(
    ("module", "args", "other_rpc"),
    [
        ("services.gateway", ["--http-port", "-1"], _generate),
        ("services.planner", ["--cluster", "1x4"], _get_placement),
    ],
    ids=["gateway", "planner"],
)
def test_the_gateway_and_planner_answer_health_alone_on_their_plaintext_port(
    tiny_model, pki, module, args, other_rpc
):
    model = ["--model", str(tiny_model)] if module == "services.gateway" else []
    common = ["--port", "0", "--health-port", "0", "--metrics-port", "-1"]
    proc = _start(module, [*model, *args, *common], pki)
    try:
        ready = _ready(proc)
        health = ready["health_address"]
        assert health != ready["address"]
        with grpc.insecure_channel(health) as channel:
            assert _check(channel) == SERVING
        with _mesh_channel(ready["address"], pki) as channel:
            assert _check(channel) == SERVING
        _assert_only_health(health, other_rpc)
        _assert_not_serving_once_draining(proc, health)
    finally:
        _stop(proc)


def test_watch_streams_held_open_never_keep_a_probes_check_waiting():
    """Anyone who reaches the port may hold Watch streams open; a Check still gets its answer
    (the servicer answers Watch without holding one of the port's two threads)."""
    from services.common.server import PlaintextHealth

    probe = PlaintextHealth("127.0.0.1", 0)
    try:
        with grpc.insecure_channel(probe.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(16)]
            assert {next(w).status for w in watches} == {NOT_SERVING}
            assert _check(channel) == NOT_SERVING
            probe.servicer.set("", SERVING)
            assert {next(w).status for w in watches} == {SERVING}
            assert _check(channel) == SERVING
            for w in watches:
                w.cancel()
    finally:
        probe.stop(0)
