"""`deploy render --planner-replicas N`: the planner as a StatefulSet whose replicas every gateway
feeds by their own names; with several, each campaigns under one election key on the mesh's
etcd with the etcd options every client gets (TLS included), a disruption budget keeps all but
one, and a standby is Ready. The last test runs the rendered replicas' own command lines against
a real etcd serving the rendered etcd's certificate: one leads, a standby is SERVING on the
kubelet's probe port and takes the workload over mTLS at its own name, and takes over when the
leader is SIGKILLed."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from distserve.etcd import Etcd
from services.common import mesh_tls
from services.common.errors import InvalidRequest
from services.common.etcd_client import DEFAULT_PREFIX, EtcdClient
from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.planner.__main__ import parse
from tests.deploy.test_render import HERE, K8S_VERSIONS, ROOT, args, find, load, objects, run_cli

NAME = "distserve-planner"
TLS = "/etc/distserve/mesh-tls"  # where a pod mounts its mesh certificate


def _render(**options) -> dict[str, list[dict]]:
    return render(load("plan_high_affinity.json"), RenderOptions(**options))


def _hosts(n: int, namespace: str = "distserve") -> list[str]:
    return [f"{NAME}-{i}.{NAME}.{namespace}.svc.cluster.local" for i in range(n)]


def _gateway_flags(manifests) -> dict[str, str]:
    return args(find(manifests, "Deployment", "distserve-gateway"), manifests)


def _planner_flags(manifests) -> dict[str, str]:
    return args(find(manifests, "StatefulSet", NAME), manifests)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "options",
    [
        {"planner_replicas": 2},
        {"planner_replicas": 3, "planner_acts": True},
        {"planner_replicas": 2, "etcd_url": "http://etcd:2379"},
        {"planner_replicas": 2, "mesh_tls": False},
    ],
)
def test_planner_replicas_validate_strictly(options, version):
    for obj in objects(_render(**options)):
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_replica_has_a_stable_name_and_every_gateway_feeds_them_all(n):
    manifests = _render(planner_replicas=n, gateway_replicas=2)
    sts = find(manifests, "StatefulSet", NAME)["spec"]
    assert (sts["replicas"], sts["serviceName"]) == (n, NAME)
    assert sts["podManagementPolicy"] == "Parallel"  # a standby waits for no other replica
    service = find(manifests, "Service", NAME)["spec"]
    assert service["clusterIP"] == "None"  # headless: each pod's own DNS name
    assert "publishNotReadyAddresses" not in service  # fed once Ready, not before
    assert service["selector"].items() <= sts["template"]["metadata"]["labels"].items()
    assert _gateway_flags(manifests)["--planner"] == ",".join(f"{h}:50052" for h in _hosts(n))
    kinds = {o["kind"] for o in objects(manifests) if o["metadata"]["name"] == NAME}
    assert "Deployment" not in kinds  # replaced by the StatefulSet, not beside it


def test_several_replicas_campaign_under_one_key_with_the_etcd_every_client_joins():
    manifests = _render(planner_replicas=2)
    planner, gateway = _planner_flags(manifests), _gateway_flags(manifests)
    for flag in ("--etcd", "--etcd-ca", "--etcd-cert", "--etcd-key", "--etcd-server-name"):
        assert planner[flag] == gateway[flag], flag  # the gateway's own, its certificate's paths
    assert planner["--etcd"].count("https://") == 3  # all three members: it fails over
    assert (planner["--etcd-cert"], planner["--etcd-server-name"]) == (
        f"{TLS}/tls.crt",
        "distserve.internal",
    )
    assert (planner["--election-key"], planner["--election-ttl-s"]) == ("planner", "5")
    # the leader as the others name it: the pod's own DNS name (POD_NAME from its metadata)
    assert planner["--advertise"] == f"<metadata.name>.{NAME}.distserve.svc.cluster.local:50052"
    config = parse([a for pair in planner.items() for a in pair])  # the planner takes them
    assert config.etcd.endpoints == tuple(gateway["--etcd"].split(","))
    assert config.etcd.cert == Path(f"{TLS}/tls.crt")
    assert config.election_key == "planner"
    pod = find(manifests, "StatefulSet", NAME)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "mesh-tls"]
    assert volume["secret"]["secretName"] == "distserve-mesh-tls-planner"
    # an existing etcd: its URLs, no TLS options (as every other client)
    existing = _render(planner_replicas=2, etcd_url="http://etcd-0.infra.svc:2379")
    flags = _planner_flags(existing)
    assert flags["--etcd"] == "http://etcd-0.infra.svc:2379" and "--etcd-ca" not in flags
    plain = _planner_flags(_render(planner_replicas=2, mesh_tls=False))
    assert plain["--etcd"].count("http://") == 3 and "--etcd-ca" not in plain


def test_one_replica_campaigns_for_nothing_and_has_no_budget():
    manifests = _render()
    flags = _planner_flags(manifests)
    assert not {"--etcd", "--election-key"} & flags.keys()  # alone it always leads
    assert find(manifests, "StatefulSet", NAME)["spec"]["replicas"] == 1
    assert not [o for o in manifests["planner.yaml"] if o["kind"] == "PodDisruptionBudget"]


@pytest.mark.parametrize("n", [2, 3])
def test_evictions_take_one_replica_at_a_time(n):
    manifests = _render(planner_replicas=n)
    budget = find(manifests, "PodDisruptionBudget", NAME)["spec"]
    assert budget == {"maxUnavailable": 1, "selector": budget["selector"]}
    labels = find(manifests, "StatefulSet", NAME)["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()


def test_a_standby_is_ready_on_the_servers_health_not_on_leadership():
    """Readiness and liveness ask grpc.health.v1 (SERVING on every replica that serves), never
    the election: the last test shows a standby SERVING there."""
    manifests = _render(planner_replicas=2)
    (c,) = find(manifests, "StatefulSet", NAME)["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["grpc"] == c["livenessProbe"]["grpc"] == {"port": 9101}
    assert _planner_flags(manifests)["--health-port"] == "9101"


def test_every_acting_replica_runs_as_the_planners_service_account():
    manifests = _render(planner_replicas=2, planner_acts=True)
    pod = find(manifests, "StatefulSet", NAME)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "distserve-planner"
    flags = _planner_flags(manifests)
    assert flags["--actuator"] == "kubernetes" and flags["--election-key"] == "planner"
    config = parse([a for pair in flags.items() for a in pair])
    assert config.autoscale.actuator == "kubernetes" and config.etcd is not None


def test_the_planners_certificate_names_each_replica():
    from cryptography import x509

    manifests = _render(planner_replicas=3, namespace="llm")
    secret = find(manifests, "Secret", "distserve-mesh-tls-planner")
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(_hosts(3, "llm")) <= set(names.get_values_for_type(x509.DNSName))
    issued = _render(planner_replicas=2, cert_manager=True)
    certificate = find(issued, "Certificate", "distserve-mesh-tls-planner")
    assert set(_hosts(2)) <= set(certificate["spec"]["dnsNames"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"planner_replicas": 0}, "--planner-replicas must be >= 1"),
        ({"planner_replicas": 2, "planner": False}, "--planner-replicas 2 needs the planner"),
    ],
)
def test_an_unusable_planner_count_is_refused_by_name(options, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        RenderOptions(**options)


def test_cli_renders_planner_replicas_and_refuses_them_without_a_planner(tmp_path):
    out = tmp_path / "k8s"
    plan = str(HERE / "plan_high_affinity.json")
    done = run_cli("--placement", plan, "--out", str(out), "--planner-replicas", "2")
    assert done.returncode == 0, done.stderr
    sts, *_ = yaml.safe_load_all((out / "planner.yaml").read_text())
    assert (sts["kind"], sts["spec"]["replicas"]) == ("StatefulSet", 2)
    done = run_cli(
        "--placement", plan, "--out", str(tmp_path / "x"), "--planner-replicas", "2",
        "--no-planner",
    )  # fmt: skip
    assert done.returncode != 0 and "--planner-replicas 2 needs the planner" in done.stderr


# -- the rendered replicas, run here ---------------------------------------------------------


def _secret_folder(manifests, component: str, folder: Path) -> Path:
    """A component's mesh certificate Secret, written as the pod mounts it."""
    folder.mkdir()
    for key, value in find(manifests, "Secret", f"distserve-mesh-tls-{component}")["data"].items():
        (folder / key).write_bytes(base64.b64decode(value))
    return folder


def _replica(manifests, certs: Path, etcd_url: str, i: int) -> tuple[subprocess.Popen, dict]:
    """The rendered planner container's command line and environment (replica `i`), with the
    mount moved to `certs`, $(ETCD_URL) to the local etcd and the fixed ports to free ones (two
    replicas share this host)."""
    (c,) = find(manifests, "StatefulSet", NAME)["spec"]["template"]["spec"]["containers"]
    flags = {
        k: v.replace(TLS, str(certs))
        .replace("$(ETCD_URL)", etcd_url)
        .replace("$(POD_NAME)", f"{NAME}-{i}")
        for k, v in zip(c["args"][0::2], c["args"][1::2], strict=True)
    }
    flags |= {"--host": "127.0.0.1", "--port": "0", "--metrics-port": "0", "--health-port": "0"}
    env = {e["name"]: e["value"].replace(TLS, str(certs)) for e in c["env"] if "value" in e}
    assert set(env) == {mesh_tls.ENV_CERT, mesh_tls.ENV_KEY, mesh_tls.ENV_CA}
    proc = subprocess.Popen(
        [sys.executable, *c["command"][1:], *(a for pair in flags.items() for a in pair)],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    ready = json.loads(proc.stdout.readline())
    assert ready["event"] == "ready", ready
    return proc, ready


def _leader(ready: dict) -> float:
    with urllib.request.urlopen(f"http://{ready['metrics_address']}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("distserve_planner_leader "):
                return float(line.split()[1])
    raise AssertionError("no distserve_planner_leader gauge")


def _probe(ready: dict) -> int:
    """What the kubelet's gRPC probe sees: grpc.health.v1 in plaintext on the health port."""
    with grpc.insecure_channel(ready["health_address"]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _feed(ready: dict, gateway: Path, name: str) -> planner_pb2.ReportWorkloadResponse:
    """A gateway's workload stream to a replica, over mTLS with the gateway's certificate,
    checking the replica's certificate for the replica's own name `name`."""
    cert, key, ca = ((gateway / f).read_bytes() for f in ("tls.crt", "tls.key", "ca.crt"))
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    options = (("grpc.ssl_target_name_override", name),)
    sample = planner_pb2.WorkloadSample(
        arrival_unix_s=time.time(), prompt_tokens=100, output_tokens=20, ttft_ms=80, tpot_ms=30
    )
    with grpc.secure_channel(ready["address"], credentials, options) as channel:
        return planner_pb2_grpc.PlannerStub(channel).ReportWorkload(iter([sample]), timeout=10)


async def _elected(config) -> str:
    """The value the election's leader campaigns with: its key, the oldest under the name."""
    client = EtcdClient(config)
    try:
        prefix = f"{DEFAULT_PREFIX}election/planner/".encode()
        request = client.rpc.RangeRequest(
            key=prefix,
            range_end=prefix[:-1] + b"0",  # "/" + 1
            limit=1,
            sort_order=client.rpc.RangeRequest.ASCEND,
            sort_target=client.rpc.RangeRequest.CREATE,
        )
        (kv,) = (await client.call(lambda: client.kv.Range(request, timeout=5))).kvs
        return kv.value.decode()
    finally:
        await client.close()


def test_the_rendered_replicas_elect_one_leader_over_etcd_tls_and_a_standby_takes_over(tmp_path):
    manifests = _render(planner_replicas=2)
    etcd_certs = _secret_folder(manifests, "etcd", tmp_path / "etcd")
    planner_certs = _secret_folder(manifests, "planner", tmp_path / "planner")
    gateway_certs = _secret_folder(manifests, "gateway", tmp_path / "gateway")
    env = {
        mesh_tls.ENV_CERT: str(etcd_certs / "tls.crt"),
        mesh_tls.ENV_KEY: str(etcd_certs / "tls.key"),
        mesh_tls.ENV_CA: str(etcd_certs / "ca.crt"),
    }
    replicas = []
    with Etcd(tls=mesh_tls.MeshTls.from_env(env)) as etcd:  # the rendered etcd's certificate
        try:
            for i in range(2):
                replicas.append(_replica(manifests, planner_certs, etcd.url, i))
            deadline = time.monotonic() + 30
            while sorted(_leader(r) for _, r in replicas) != [0.0, 1.0]:
                assert time.monotonic() < deadline, "no single leader"
                time.sleep(0.1)
            lead = [_leader(r) for _, r in replicas].index(1.0)
            standby = replicas[1 - lead][1]
            serving = health_pb2.HealthCheckResponse.SERVING
            assert _probe(standby) == _probe(replicas[lead][1]) == serving  # both Ready
            for ready, host in zip((r for _, r in replicas), _hosts(2), strict=True):
                assert _feed(ready, gateway_certs, host).samples == 1  # each takes the feed
            # the leader as the others see it: the address a client in the cluster can dial
            assert asyncio.run(_elected(etcd.config)) == f"{_hosts(2)[lead]}:50052"
            replicas[lead][0].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            while _leader(standby) != 1.0:
                assert time.monotonic() - killed < 5 + 5, "the standby never took over"
                time.sleep(0.05)
            took = time.monotonic() - killed
            assert took <= 5 + 0.6, f"took over {took:.2f} s after the kill (lease TTL 5 s)"
            assert _probe(standby) == serving
        finally:
            for proc, _ in replicas:
                proc.kill()
                proc.wait(timeout=10)
