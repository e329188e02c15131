"""Mesh mTLS as `deploy render` makes it by default (distserve/deploy/mesh_certs.py): a CA and a
certificate per component whose names are its Service's, mounted into exactly that component's
pods; a mesh process started with them serves mutual TLS and refuses callers without one; or
cert-manager resources writing the same Secrets (--cert-manager); or none (--no-mesh-tls)."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time

import grpc
import kubernetes_validate
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve.deploy.mesh_certs import SECRET_PREFIX
from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from distserve.deploy.secrets import SecretFiles
from services.common import mesh_tls
from services.common.errors import InvalidRequest
from tests.certs import mesh_pki
from tests.deploy.test_render import (
    K8S_VERSIONS,
    ROOT,
    WORKLOADS,
    edge_bootstrap,
    load,
    objects,
)

COMPONENTS = ("gateway", "envoy", "planner", "prefill", "decode", "etcd")


@pytest.fixture(scope="module")
def mesh() -> dict[str, list[dict]]:
    return render(load("plan_high_affinity.json"), RenderOptions(namespace="llm"))


def secret_files(manifests, name: str) -> dict[str, bytes]:
    (secret,) = [o for o in manifests["secrets.yaml"] if o["metadata"]["name"] == name]
    assert secret["type"] == "kubernetes.io/tls"
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def pods(manifests) -> list[tuple[str, dict]]:
    return [
        (d["metadata"]["labels"]["app.kubernetes.io/component"], d["spec"]["template"]["spec"])
        for d in objects(manifests)
        if d["kind"] in WORKLOADS
    ]


def test_each_pods_grpc_ports_are_covered_by_a_certificate_naming_its_service(mesh):
    services = {o["metadata"]["name"]: o for o in objects(mesh) if o["kind"] == "Service"}
    cas, keys = set(), set()
    for component, pod in pods(mesh):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "mesh-tls"]
        assert volume["secret"]["secretName"] == f"{SECRET_PREFIX}-{component}"
        files = secret_files(mesh, volume["secret"]["secretName"])
        cert = x509.load_pem_x509_certificate(files["tls.crt"])
        ca = x509.load_pem_x509_certificate(files["ca.crt"])
        cert.verify_directly_issued_by(ca)  # raises if not signed by the CA
        assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = set(names.get_values_for_type(x509.DNSName))
        service = f"distserve-{component}"
        assert service in services  # the Service whose names the certificate carries
        # the planner's also each replica's own name, the address the gateways dial
        replica = f"distserve-planner-0.{service}.llm.svc.cluster.local"
        replicas = [replica] if component == "planner" else []
        assert {
            mesh_tls.SERVER_NAME, service, f"{service}.llm", f"{service}.llm.svc",
            f"{service}.llm.svc.cluster.local", *replicas,
        } == dns  # fmt: skip
        cas.add(files["ca.crt"])
        keys.add(files["tls.key"])
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            if c["name"] == "stage-model":
                continue  # the staging step talks to the Hub, not to the mesh
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            grpc_port = any(p["name"] == "grpc" for p in c.get("ports", []))
            if grpc_port or c["name"] == "envoy-config":  # Envoy's step writes its files' paths
                assert env.get(mesh_tls.ENV_CERT) == "/etc/distserve/mesh-tls/tls.crt", c["name"]
            if grpc_port or component == "envoy":
                mounts = {m["name"]: m for m in c["volumeMounts"]}
                assert mounts["mesh-tls"]["mountPath"] == "/etc/distserve/mesh-tls"
            if any(p["name"] == "grpc" for p in c.get("ports", [])):  # probes: plaintext health
                assert c["readinessProbe"]["grpc"] == {"port": 9101}
    assert len(cas) == 1  # one CA for the mesh
    assert len(keys) == len(COMPONENTS)  # a key of its own per component
    for obj in objects(mesh):
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def test_rendering_again_makes_a_new_ca_and_the_ca_key_is_not_shipped(mesh):
    again = render(load("plan_high_affinity.json"), RenderOptions(namespace="llm"))
    name = f"{SECRET_PREFIX}-gateway"
    assert secret_files(mesh, name)["ca.crt"] != secret_files(again, name)["ca.crt"]
    for secret in mesh["secrets.yaml"]:
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}


def test_envoy_reaches_the_gateway_over_the_generated_mesh_tls(mesh, tmp_path):
    bootstrap = edge_bootstrap(mesh, tmp_path)  # the pod's own config step, then envoy validate
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"].startswith("gateway_"):
            assert cluster["transport_socket"]["name"] == "envoy.transport_sockets.tls"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int, credentials: grpc.ChannelCredentials) -> int:
    options = (("grpc.ssl_target_name_override", mesh_tls.SERVER_NAME),)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_process_with_its_generated_certificate_serves_mtls_to_the_mesh_only(mesh, tmp_path):
    """The planner with its own certificate; the gateway's (another component's, the same CA)
    is let in, no certificate or one of another CA is refused at the handshake."""
    paths = {}
    for component in ("planner", "gateway"):
        folder = tmp_path / component
        folder.mkdir()
        for key, data in secret_files(mesh, f"{SECRET_PREFIX}-{component}").items():
            (folder / key).write_bytes(data)
        paths[component] = [folder / k for k in ("tls.crt", "tls.key", "ca.crt")]
    cert, key, ca = (str(p) for p in paths["planner"])
    env = os.environ | {mesh_tls.ENV_CERT: cert, mesh_tls.ENV_KEY: key, mesh_tls.ENV_CA: ca}
    port = _free_port()
    planner = subprocess.Popen(
        [sys.executable, "-m", "services.planner", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env | {"PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        gateway = grpc.ssl_channel_credentials(
            *(
                p.read_bytes()
                for p in (paths["gateway"][2], paths["gateway"][1], paths["gateway"][0])
            )
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                assert _health(port, gateway) == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.RpcError:
                assert planner.poll() is None, planner.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the planner never served"
                time.sleep(0.5)
        intruder_cert, intruder_key, _ = mesh_pki(tmp_path, "intruder")
        refused = {
            "no certificate": grpc.ssl_channel_credentials(paths["gateway"][2].read_bytes()),
            "another CA's": grpc.ssl_channel_credentials(
                paths["gateway"][2].read_bytes(), intruder_key.read_bytes(),
                intruder_cert.read_bytes(),
            ),
        }  # fmt: skip
        for who, credentials in refused.items():
            with pytest.raises(grpc.RpcError) as e:
                _health(port, credentials)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, who
        assert planner.poll() is None
    finally:
        planner.terminate()
        planner.wait(timeout=30)


def test_cert_manager_writes_the_same_secrets_instead():
    m = render(load("plan_high_affinity.json"), RenderOptions(cert_manager=True))
    assert "secrets.yaml" not in m  # nothing generated here
    issued = {
        o["spec"]["secretName"]: o
        for o in m["mesh-certificates.yaml"]
        if o["kind"] == "Certificate" and not o["spec"].get("isCA")
    }
    for component, pod in pods(m):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "mesh-tls"]
        cert = issued[volume["secret"]["secretName"]]
        assert f"distserve-{component}.distserve.svc.cluster.local" in cert["spec"]["dnsNames"]
        assert mesh_tls.SERVER_NAME in cert["spec"]["dnsNames"]
        issuer = cert["spec"]["issuerRef"]["name"]
        (ca_issuer,) = [
            o for o in m["mesh-certificates.yaml"]
            if o["kind"] == "Issuer" and o["metadata"]["name"] == issuer
        ]  # fmt: skip
        (ca,) = [
            o for o in m["mesh-certificates.yaml"]
            if o["kind"] == "Certificate" and o["spec"].get("isCA")
        ]  # fmt: skip
        assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    resources = m["kustomization.yaml"][0]["resources"]
    assert resources.index("mesh-certificates.yaml") < resources.index("gateway.yaml")


def test_no_mesh_tls_mounts_nothing_and_probes_the_grpc_port():
    m = render(load("plan_high_affinity.json"), RenderOptions(mesh_tls=False))
    assert "secrets.yaml" not in m and "mesh-certificates.yaml" not in m
    for _, pod in pods(m):
        assert all(v["name"] != "mesh-tls" for v in pod.get("volumes", []))


def test_a_given_mesh_certificate_is_used_by_every_pod_as_before(tmp_path):
    cert, key, ca = mesh_pki(tmp_path)
    given = SecretFiles(mesh_tls_cert=cert, mesh_tls_key=key, mesh_tls_ca=ca)
    m = render(load("plan_high_affinity.json"), RenderOptions(secrets=given))
    assert [s["metadata"]["name"] for s in m["secrets.yaml"]] == ["distserve-mesh-tls"]
    for _, pod in pods(m):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "mesh-tls"]
        assert volume["secret"]["secretName"] == "distserve-mesh-tls"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mesh_tls": False, "cert_manager": True}, "--no-mesh-tls turns mesh TLS off"),
        (
            {"mesh_tls": False, "secrets": SecretFiles(mesh_tls_secret="mine")},
            "--no-mesh-tls turns mesh TLS off",
        ),
        (
            {"cert_manager": True, "secrets": SecretFiles(mesh_tls_secret="mine")},
            "--cert-manager issues the mesh's certificates: drop --mesh-tls-",
        ),
    ],
)
def test_contradictory_mesh_tls_options_are_refused_by_name(options, message):
    with pytest.raises(InvalidRequest, match=message):
        RenderOptions(**options)
