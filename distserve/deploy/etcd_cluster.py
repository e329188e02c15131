"""The mesh's etcd on Kubernetes: a 3-member StatefulSet, unless `--etcd URL` names an existing one.

The mesh's membership lives in etcd (services/common/discovery.py): every worker keeps a
lease-backed entry there, every gateway watches it. Three members keep a quorum through one
member's loss (a node drain, a restart, an upgrade), which the PodDisruptionBudget enforces:
at most one member is evicted at a time. Members find each other by stable names through a
headless Service that lists them before they are ready (a member is ready only once a quorum
exists, which needs its peers). Every client (worker, gateway) is given the three members' own
names (`--etcd URL,URL,URL`), so it moves on to another member when the one it uses goes
(services/common/etcd_client.py); the Service `distserve-etcd` lists the ready members for
anyone else (etcdctl). Each member keeps its data on its own PersistentVolumeClaim, so a
restarted member rejoins with its log instead of as a stranger; the mesh's entries are leases of
a few seconds, so nothing outlives a lost volume for long anyway.

The image is etcd's own release (`gcr.io/etcd-development/etcd`, the project's primary
registry; quay.io/coreos/etcd mirrors it), at the 3.5 minor of the etcd `distserve up` starts,
whose v3 gRPC API the mesh's client speaks. Under mesh TLS (the default) the members serve their
clients TLS with a mesh certificate (the component `etcd`'s, of the mesh's CA: mesh_certs.py)
and require a client certificate of that CA (`--client-cert-auth`): every client presents its
own mesh certificate and checks the name every mesh certificate carries (SERVER_NAME). Peer
traffic stays plaintext: only the members reach each other's peer port (network_policy.py),
and etcd checks a peer's certificate against the peer's IP address, which a StatefulSet pod
does not keep.
"""

from __future__ import annotations

from distserve.deploy import objects as k8s
from distserve.deploy.monitoring import scrape_annotations
from distserve.deploy.options import RenderOptions
from distserve.deploy.resources import ETCD, fixed
from distserve.deploy.secrets import MeshSecrets
from services.common.mesh_tls import ENV_CA, ENV_CERT, ENV_KEY, SERVER_NAME

NAME, PEERS = "distserve-etcd", "distserve-etcd-peers"
MEMBERS = 3  # a quorum of 2 survives one member's loss
CLIENT_PORT, PEER_PORT, METRICS_PORT = 2379, 2380, 2381
STORAGE = "1Gi"  # each member's volume; the mesh's keys are a few KiB per worker
DATA_DIR = "/var/lib/etcd"


def etcd_url(o: RenderOptions) -> str:
    """The client URLs every worker and gateway joins (`--etcd`): the existing cluster's, or
    each rendered member's own (https under mesh TLS)."""
    if o.etcd_url:
        return o.etcd_url
    scheme = "https" if o.mesh_tls else "http"
    members = (_peer(o, f"{NAME}-{i}") for i in range(MEMBERS))
    return ",".join(f"{scheme}://{member}:{CLIENT_PORT}" for member in members)


def _tls_files(secrets: MeshSecrets) -> dict[str, str]:
    """The mounted mesh certificate's files (cert, key, CA) by mesh_tls's variable names."""
    return {e["name"]: e["value"] for e in secrets.mesh_tls_env()}


def etcd_client_args(o: RenderOptions, secrets: MeshSecrets) -> list[str]:
    """The etcd options of a pod that joins the mesh's etcd beside `--etcd`: `--etcd-prefix`
    when given, and for the rendered etcd under mesh TLS its TLS options (the pod mounts its
    mesh certificate)."""
    prefix = ["--etcd-prefix", o.etcd_prefix] if o.etcd_prefix else []
    if o.etcd_url or secrets.mesh_tls is None:
        return prefix
    files = _tls_files(secrets)
    return [
        "--etcd-ca", files[ENV_CA], "--etcd-cert", files[ENV_CERT], "--etcd-key", files[ENV_KEY],
        "--etcd-server-name", SERVER_NAME, *prefix,
    ]  # fmt: skip


def etcd_cluster(o: RenderOptions, secrets: MeshSecrets) -> list[dict]:
    """The StatefulSet, its two Services and its disruption budget."""
    ns = o.namespace
    peers = k8s.service(PEERS, "etcd", ns, [("client", CLIENT_PORT), ("peer", PEER_PORT)], True)
    peers["spec"]["publishNotReadyAddresses"] = True  # members meet before a quorum exists
    client = k8s.service(NAME, "etcd", ns, [("client", CLIENT_PORT)])
    budget = k8s.disruption_budget("etcd", ns, min_available=MEMBERS // 2 + 1)
    return [_stateful_set(o, secrets), peers, client, budget]


def _peer(o: RenderOptions, member: str) -> str:
    return f"{member}.{PEERS}.{o.namespace}.svc.{o.cluster_domain}"


def _stateful_set(o: RenderOptions, secrets: MeshSecrets) -> dict:
    me = _peer(o, "$(POD_NAME)")
    scheme = "https" if secrets.mesh_tls is not None else "http"
    initial = ",".join(
        f"{NAME}-{i}=http://{_peer(o, f'{NAME}-{i}')}:{PEER_PORT}" for i in range(MEMBERS)
    )
    args = [
        "--name=$(POD_NAME)",
        f"--data-dir={DATA_DIR}",
        f"--listen-client-urls={scheme}://0.0.0.0:{CLIENT_PORT}",
        f"--advertise-client-urls={scheme}://{me}:{CLIENT_PORT}",
        f"--listen-peer-urls=http://0.0.0.0:{PEER_PORT}",
        f"--initial-advertise-peer-urls=http://{me}:{PEER_PORT}",
        f"--listen-metrics-urls=http://0.0.0.0:{METRICS_PORT}",
        f"--initial-cluster={initial}",
        f"--initial-cluster-token={NAME}",
        "--initial-cluster-state=new",  # ignored once a member has data: restarts rejoin
        "--auto-compaction-mode=periodic",
        "--auto-compaction-retention=1h",  # lease churn would otherwise grow the log
    ]
    volumes, tls_mounts = secrets.mesh_tls_volumes("etcd")
    if secrets.mesh_tls is not None:
        files = _tls_files(secrets)
        args += [
            f"--cert-file={files[ENV_CERT]}", f"--key-file={files[ENV_KEY]}",
            f"--trusted-ca-file={files[ENV_CA]}", "--client-cert-auth=true",
        ]  # fmt: skip
    # Liveness asks this member alone (serializable): a member waiting for its peers is alive.
    # Readiness asks for the quorum's answer: the client Service lists members that serve.
    alive = {"httpGet": {"path": "/health?serializable=true", "port": METRICS_PORT}}
    ready = {"httpGet": {"path": "/health", "port": METRICS_PORT}}
    probes = {
        "startupProbe": {**alive, "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**alive, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
    }
    ports = [("client", CLIENT_PORT), ("peer", PEER_PORT), ("metrics", METRICS_PORT)]
    etcd = k8s.container(
        "etcd", o.etcd_image, o.image_pull_policy, ["/usr/local/bin/etcd"], args,
        env=[k8s.from_field("POD_NAME", "metadata.name")], ports=ports, probes=probes,
        resources=fixed(ETCD), mounts=[{"name": "data", "mountPath": DATA_DIR}, *tls_mounts],
    )  # fmt: skip
    template = {
        "metadata": {
            "labels": k8s.labels("etcd"),
            "annotations": scrape_annotations() | {"prometheus.io/port": str(METRICS_PORT)},
        },
        "spec": {"containers": [etcd], "terminationGracePeriodSeconds": 30}
        | ({"volumes": volumes} if volumes else {}),
    }
    claim = {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": STORAGE}}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": k8s.meta(NAME, "etcd", o.namespace),
        "spec": {
            "serviceName": PEERS,
            "replicas": MEMBERS,
            "podManagementPolicy": "Parallel",  # all members start together: a quorum needs them
            "selector": {"matchLabels": k8s.selector("etcd")},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": template,
            "volumeClaimTemplates": [claim],
        },
    }
