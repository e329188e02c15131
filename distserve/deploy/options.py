"""What `deploy render` needs beyond the plan: the image, the model's volume, the Secrets, the
edge, sizes. One frozen dataclass, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from distserve import __version__
from distserve.deploy.model_volume import ModelSource
from distserve.deploy.resources import DEVICES
from distserve.deploy.secrets import SecretFiles
from distserve.role_args import RoleArgs
from services.common.errors import InvalidRequest
from services.common.etcd_client import EtcdConfig, check_prefix

SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DEFAULT_IMAGE = f"distserve-mesh:{__version__}"  # what `make image` builds and tags
# etcd's own release image (its primary registry), the 3.5 minor `distserve up` runs
DEFAULT_ETCD_IMAGE = "gcr.io/etcd-development/etcd:v3.5.21"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class RenderOptions:
    """What the placement does not say: where the image and the model are, the Secrets, names,
    the edge, and the hardware the pods are sized for."""

    namespace: str = "distserve"
    image: str = DEFAULT_IMAGE  # holds this package (and so the `envoy` binary)
    image_pull_policy: str = "IfNotPresent"
    model: ModelSource = field(default_factory=ModelSource)
    secrets: SecretFiles = field(default_factory=SecretFiles)
    # The model the pods are sized for: a preset (opt-13b ...) or a folder with its config.json;
    # None: the plan's own (`distserve plan --model-spec`).
    model_spec: str | None = None
    device: str = "cuda"  # what the workers compute on: "cuda" (GPU pods) or "cpu"
    gpu_memory_gib: float = 80.0  # one GPU's memory (the planner's profiles: A100-80GB)
    cpus_per_rank: int = 4  # cores a worker pod requests per rank
    service_monitor: bool = False  # render a ServiceMonitor (needs the Prometheus operator)
    served_model_name: str | None = None  # the HTTP API's model name (default: the folder's)
    slo_ttft_ms: float | None = None  # default: the plan's SLOs
    slo_tpot_ms: float | None = None
    baseline: bool = False  # render the plan's colocated baseline instead of its placement
    planner: bool = True  # run a planner that the gateway feeds the live workload
    # the planner scales and drains the worker Deployments itself (its ServiceAccount and Role:
    # planner_rbac.py); False: it recommends only
    planner_acts: bool = False
    # planner replicas: with several, one leads (an election on the mesh's etcd) and the others
    # stand by (planner.py)
    planner_replicas: int = 1
    # mesh mTLS (mesh_certs.py): generated certificates unless the secrets name the mesh's own
    mesh_tls: bool = True
    cert_manager: bool = False  # cert-manager Certificates instead of generated ones
    # NetworkPolicies (network_policy.py): only the mesh's own callers reach its ports
    network_policies: bool = True
    # the namespaces Prometheus scrapes from: a label KEY=VALUE (network_policy.py)
    monitoring_namespace_label: str = "kubernetes.io/metadata.name=monitoring"
    gateway_replicas: int = 1  # gateways behind Envoy; each sees the whole mesh through etcd
    # an existing etcd's client URLs (http://HOST:PORT, comma-separated) the mesh joins; None:
    # render a 3-member etcd StatefulSet (etcd_cluster.py) from etcd_image
    etcd_url: str | None = None
    etcd_image: str = DEFAULT_ETCD_IMAGE
    # where under etcd's keys this mesh keeps its membership and elections (None: the default,
    # /distserve/): meshes sharing one existing etcd each need their own
    etcd_prefix: str | None = None
    edge_port: int = 8080
    edge_replicas: int = 1
    edge_service_type: str = "ClusterIP"
    rate_limit_rps: int = 100  # over each Envoy replica; 0 is off
    termination_grace_s: int = 60  # how long a worker may drain after SIGTERM
    cluster_domain: str = "cluster.local"
    # Each process's own options, appended to its container's args (distserve/role_args.py:
    # checked by `deploy render`'s command line before they get here).
    passed: RoleArgs = field(default_factory=RoleArgs)

    def __post_init__(self) -> None:
        if not _DNS_LABEL.fullmatch(self.namespace):
            raise InvalidRequest(f"namespace {self.namespace!r} is not a DNS label", "namespace")
        if self.image_pull_policy not in PULL_POLICIES:
            raise InvalidRequest(f"image pull policy must be one of {PULL_POLICIES}")
        if self.edge_service_type not in SERVICE_TYPES:
            raise InvalidRequest(f"edge service type must be one of {SERVICE_TYPES}")
        if self.device not in DEVICES:
            raise InvalidRequest(f"--device must be one of {DEVICES}, not {self.device!r}")
        if self.planner_acts and not self.planner:
            raise InvalidRequest("--planner-acts needs the planner: drop --no-planner")
        if self.planner_replicas < 1:
            raise InvalidRequest("--planner-replicas must be >= 1", "planner_replicas")
        if self.planner_replicas > 1 and not self.planner:
            raise InvalidRequest(
                f"--planner-replicas {self.planner_replicas} needs the planner: drop --no-planner",
                "planner_replicas",
            )
        if self.edge_replicas < 1 or self.termination_grace_s < 1 or self.rate_limit_rps < 0:
            raise InvalidRequest("edge replicas and the grace period must be >= 1, rps >= 0")
        if self.gateway_replicas < 1:
            raise InvalidRequest("--gateway-replicas must be >= 1", "gateway_replicas")
        if self.etcd_url is not None and "https://" in self.etcd_url:
            raise InvalidRequest(
                "--etcd https://...: an existing etcd over TLS is not rendered (its CA and a "
                "client certificate would have to reach every pod); give its http:// URLs, or "
                "drop --etcd: the rendered etcd speaks TLS with the mesh's certificates",
                "etcd",
            )
        if self.etcd_url is not None:
            EtcdConfig.parse(self.etcd_url)  # InvalidRequest naming --etcd
        if self.etcd_prefix is not None:
            check_prefix(self.etcd_prefix)
        if not 0 < self.edge_port < 65536:
            raise InvalidRequest(f"edge port {self.edge_port} is not a port", "edge_port")
        s, given = self.secrets, self.secrets.mesh_tls_secret or self.secrets.mesh_tls_cert
        if not self.mesh_tls and (given or self.cert_manager):
            raise InvalidRequest(
                "--no-mesh-tls turns mesh TLS off: drop it, or drop --mesh-tls-* and --cert-manager"
            )
        if self.cert_manager and (given or s.mesh_tls_key or s.mesh_tls_ca):
            raise InvalidRequest("--cert-manager issues the mesh's certificates: drop --mesh-tls-*")
        key, eq, value = self.monitoring_namespace_label.partition("=")
        if not (eq and _LABEL_KEY.fullmatch(key) and _LABEL_VALUE.fullmatch(value)):
            raise InvalidRequest(
                f"--monitoring-namespace-label {self.monitoring_namespace_label!r} is not a "
                "label KEY=VALUE (e.g. kubernetes.io/metadata.name=monitoring)"
            )
        if self.gpu_memory_gib <= 0 or self.cpus_per_rank < 1:
            raise InvalidRequest("--gpu-memory-gib must be > 0 and --cpus-per-rank >= 1")

    @property
    def monitoring_namespace(self) -> dict[str, str]:
        """monitoring_namespace_label as a matchLabels selector."""
        key, _, value = self.monitoring_namespace_label.partition("=")
        return {key: value}

    def service_address(self, name: str, port: int) -> str:
        return f"{name}.{self.namespace}.svc.{self.cluster_domain}:{port}"


def gpus_per_node(plan: dict) -> int | None:
    """GPUs per node from a plan's cluster (None when it does not say)."""
    n = (plan.get("cluster") or {}).get("gpus_per_node")
    return n if isinstance(n, int) and n > 0 else None
