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

The pieces live beside this file: options.py (RenderOptions), objects.py (the object builders),
pod.py (what every pod shares: probes, the model volume, mesh TLS), secrets.py, resources.py
(requests and limits), model_volume.py (the model and its staging), edge.py (Envoy),
etcd_cluster.py (the mesh's etcd), planner.py (the planner's replicas), monitoring.py,
network_policy.py (who may reach which port), mesh_certs.py (mesh mTLS).
"""

from __future__ import annotations

import json
from pathlib import Path

from distserve.deploy import objects as k8s
from distserve.deploy.edge import envoy
from distserve.deploy.etcd_cluster import etcd_client_args, etcd_cluster, etcd_url
from distserve.deploy.mesh_certs import with_mesh_certs
from distserve.deploy.monitoring import service_monitor
from distserve.deploy.network_policy import network_policies
from distserve.deploy.objects import (
    GATEWAY_GRPC_PORT,
    GATEWAY_HTTP_PORT,
    GPU,
    MESH_CONFIG,
    METRICS_PORT,
    NODE_GROUP,
    UCX_PORT,
    UCX_TCP_PORTS,
    WORKER_PORT,
)
from distserve.deploy.options import RenderOptions, gpus_per_node
from distserve.deploy.planner import planner, planner_address
from distserve.deploy.planner_rbac import planner_rbac
from distserve.deploy.pod import MeshPods
from distserve.deploy.pools import WORKER_ROLES, WorkerPool, select_placement, worker_pools
from distserve.deploy.resources import (
    GATEWAY,
    SHM_BYTES,
    fixed,
    quantity,
    worker_footprint,
)
from distserve.deploy.secrets import mesh_secrets
from distserve.role_args import worker_options
from services.common.errors import InvalidRequest
from services.common.model_spec import ModelSpec, model_spec


def render(plan: dict, options: RenderOptions | None = None) -> dict[str, list[dict]]:
    """File name -> Kubernetes objects: the whole mesh for the plan's placement."""
    o = options or RenderOptions()
    pools = worker_pools(select_placement(plan, o.baseline), gpus_per_node(plan))
    config = _mesh_config(plan, o)
    components = ["gateway", "envoy", *(["planner"] if o.planner else [])]
    components += list(dict.fromkeys(p.role for p in pools))  # those with pods
    components += ["etcd"] if o.etcd_url is None else []  # the rendered etcd's certificate
    secrets = mesh_secrets(o.secrets, o.namespace, k8s.labels("secrets"))
    secrets, certificates = with_mesh_certs(secrets, o, components)
    mesh = MeshPods(o, secrets, _model_spec(plan, o), k8s.digest(config["data"]))
    files: dict[str, list[dict]] = {
        "namespace.yaml": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": o.namespace}}
        ],
    }
    if secrets.objects:
        files["secrets.yaml"] = secrets.objects
    files |= {"mesh-certificates.yaml": certificates} if certificates else {}
    files["config.yaml"] = [config]
    if o.etcd_url is None:
        files["etcd.yaml"] = etcd_cluster(o, secrets)
    files["gateway.yaml"] = _gateway(mesh, config["data"])
    if o.planner_acts:
        files["planner-rbac.yaml"] = planner_rbac(o.namespace)
    if o.planner:
        files["planner.yaml"] = planner(mesh, plan, pools, config["data"])
    files["envoy.yaml"] = envoy(mesh)
    for role in WORKER_ROLES:
        mine = [p for p in pools if p.role == role]
        if mine:
            files[f"{role}.yaml"] = [
                *(_worker(p, mesh) for p in mine),
                k8s.service(f"distserve-{role}", role, o.namespace, _worker_ports(role), True),
                k8s.disruption_budget(role, o.namespace),
            ]
    if o.network_policies:
        files["network-policies.yaml"] = network_policies(o, components, pools)
    if o.service_monitor:
        files["monitoring.yaml"] = [service_monitor(o.namespace)]
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
    """Write each file as a YAML stream; returns the paths written. `secrets.yaml` (the secrets
    themselves) is written readable by its owner only."""
    dumper = _dumper()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, objects in manifests.items():
        path = out_dir / name
        path.touch()
        path.chmod(0o600 if name == "secrets.yaml" else 0o644)
        path.write_text(dumper(objects))
        paths.append(path)
    return paths


def _dumper():
    """yaml.dump_all with multi-line strings (the plan) as literal blocks."""
    import yaml  # only when writing: `distserve --help` stays fast

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True  # no &id001 anchors: plain YAML a person reads

    def string(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)

    Dumper.add_representer(str, string)
    return lambda objects: yaml.dump_all(objects, Dumper=Dumper, sort_keys=False)


def _model_spec(plan: dict, o: RenderOptions) -> ModelSpec:
    name = o.model_spec or plan.get("model")
    if not isinstance(name, str):
        raise InvalidRequest("the plan names no model: give --model-spec (what pods are sized for)")
    try:
        return model_spec(name)
    except InvalidRequest as e:
        raise InvalidRequest(
            f"cannot size the pods for the model {name!r} ({e}): give --model-spec, a preset or "
            "a folder with the model's config.json"
        ) from e


def _mesh_config(plan: dict, o: RenderOptions) -> dict:
    """What every pod reads through environment variables: one place to change the model
    folder, the addresses and the SLOs; and the plan itself, for the record."""
    slo = plan.get("slo_ms") or {}
    data = {
        "MODEL_DIR": o.model.folder,
        "GATEWAY_ADDRESS": o.service_address("distserve-gateway", GATEWAY_GRPC_PORT),
        # The mesh's membership (services/common/discovery.py): every worker and gateway joins
        # it (etcd_cluster.py).
        "ETCD_URL": etcd_url(o),
    }
    if o.planner:
        data["PLANNER_ADDRESS"] = planner_address(o)  # every replica's
    for key, value in (
        ("SLO_TTFT_MS", o.slo_ttft_ms if o.slo_ttft_ms is not None else slo.get("ttft")),
        ("SLO_TPOT_MS", o.slo_tpot_ms if o.slo_tpot_ms is not None else slo.get("tpot")),
    ):
        if isinstance(value, int | float):
            data[key] = f"{value:g}"
    if o.served_model_name:
        data["SERVED_MODEL_NAME"] = o.served_model_name
    data["plan.json"] = json.dumps(plan, indent=1) + "\n"
    return k8s.config_map(MESH_CONFIG, "mesh", o.namespace, data)


def _gateway(m: MeshPods, config: dict[str, str]) -> list[dict]:
    """`gateway_replicas` gateways, each seeing the whole mesh through etcd. The Service is
    headless, so Envoy (STRICT_DNS) sees every gateway pod, balances over them and retries a
    request not yet answered on another. Roll-outs add a new gateway before removing an old one
    (maxSurge 1, maxUnavailable 0), and with several, voluntary evictions leave all but one
    serving: an evicted or deleted gateway drops only the streams it had begun
    (docs/deployment.md, "A gateway dies")."""
    args = ["--model", "$(MODEL_DIR)", "--host", "0.0.0.0", "--port", str(GATEWAY_GRPC_PORT)]
    args += ["--http-port", str(GATEWAY_HTTP_PORT), "--metrics-port", str(METRICS_PORT)]
    env = [k8s.from_config("MODEL_DIR")]
    for flag, key in (
        ("--served-model-name", "SERVED_MODEL_NAME"),
        ("--slo-ttft-ms", "SLO_TTFT_MS"),
        ("--slo-tpot-ms", "SLO_TPOT_MS"),
        ("--planner", "PLANNER_ADDRESS"),
        ("--etcd", "ETCD_URL"),
    ):
        if key in config:
            args += [flag, f"$({key})"]
            env.append(k8s.from_config(key))
    args += etcd_client_args(m.o, m.secrets)
    health_args, health_ports, probes = m.health(GATEWAY_GRPC_PORT)
    args += health_args + list(m.o.passed.gateway)
    ports = [("grpc", GATEWAY_GRPC_PORT), ("http", GATEWAY_HTTP_PORT), ("metrics", METRICS_PORT)]
    gateway = m.container(
        "gateway", ["python", "-m", "services.gateway"], args, env=env,
        ports=ports + health_ports, probes=probes, resources=fixed(GATEWAY),
    )  # fmt: skip
    pod = m.model_pod([gateway], [], tokenizer_only=True)  # the gateway loads no weights
    name, ns, n = "distserve-gateway", m.o.namespace, m.o.gateway_replicas
    surge = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    objects = [
        k8s.deployment(
            name, "gateway", ns, pod, annotations=m.annotations(), strategy=surge, replicas=n
        ),
        k8s.service(name, "gateway", ns, ports, headless=True),
    ]
    if n > 1:
        objects.append(k8s.disruption_budget("gateway", ns, min_available=n - 1))
    return objects


def _worker(pool: WorkerPool, m: MeshPods) -> dict:
    """A worker pool's Deployment. The pod advertises its own IP to the gateway; SIGTERM starts
    its drain (health NOT_SERVING, deregister, finish in-flight work) within the grace period."""
    o = m.o
    passed = o.passed.for_worker(pool.role)
    footprint = worker_footprint(
        m.spec, pool, worker_options(pool.role, passed), device=o.device,
        gpu_memory_gib=o.gpu_memory_gib, cpus_per_rank=o.cpus_per_rank,
    )  # fmt: skip
    module = "services.prefill" if pool.role == "prefill" else "services.decode"
    args = ["--model", "$(MODEL_DIR)", "--etcd", "$(ETCD_URL)", *etcd_client_args(o, m.secrets)]
    args += ["--host", "$(POD_IP)"]
    args += ["--port", str(WORKER_PORT), "--worker-id", "$(POD_NAME)"]
    args += ["--metrics-port", str(METRICS_PORT), "--tensor-parallel-size", str(pool.tp)]
    args += ["--ucx-port", str(UCX_PORT)] if pool.role == "prefill" else ["--role", pool.role]
    if footprint.kv_cache_bytes is not None:
        args += ["--kv-cache-gib", repr(footprint.kv_cache_bytes / 2**30)]
    health_args, health_ports, probes = m.health(WORKER_PORT)
    args += health_args + list(passed)
    env = [
        k8s.from_field("POD_IP", "status.podIP"),
        k8s.from_field("POD_NAME", "metadata.name"),
        k8s.from_config("MODEL_DIR"),
        k8s.from_config("ETCD_URL"),
        # UCX's TCP listeners in the range the NetworkPolicies open (network_policy.py)
        {"name": "UCX_TCP_PORT_RANGE", "value": "{}-{}".format(*UCX_TCP_PORTS)},
    ]
    worker = m.container(
        pool.role, ["python", "-m", module], args, env=env,
        ports=_worker_ports(pool.role) + health_ports, probes=probes,
        resources=footprint.resources(),
        mounts=[{"name": "dshm", "mountPath": "/dev/shm"}],
    )  # fmt: skip
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(SHM_BYTES)}}
    pod = {"terminationGracePeriodSeconds": o.termination_grace_s} | m.model_pod([worker], [shm])
    if footprint.gpus:
        pod["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
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
    return k8s.deployment(
        pool.name, pool.role, o.namespace, pod, annotations=m.annotations(), strategy=strategy,
        node_group=pool.node_group, replicas=pool.replicas,
    )  # fmt: skip


def _worker_ports(role: str) -> k8s.Ports:
    ports = [("grpc", WORKER_PORT), ("metrics", METRICS_PORT)]
    return [*ports, ("ucx", UCX_PORT)] if role == "prefill" else ports
