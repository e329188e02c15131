"""The Kubernetes objects every rendered file is made of, and the names and ports they share.

Builders return plain dicts (what `yaml.dump` writes and `kubernetes-validate` checks); they know
nothing of the plan. Every object carries the recommended `app.kubernetes.io/*` labels, and a
Deployment's pods are selected by component and `part-of` only, so labels added later (a node
group, annotations) never change a selector.
"""

from __future__ import annotations

import hashlib
import json

PART_OF = "distserve"
NODE_GROUP = "distserve.io/node-group"  # the node label low-affinity pods require
CONFIG_HASH = "distserve.io/config-hash"  # on pod templates: a config change rolls the pods
METRICS_LABEL = "distserve.io/metrics"  # "true" on every Service with a `metrics` port
GPU = "nvidia.com/gpu"
MESH_CONFIG = "distserve-mesh"
GATEWAY_GRPC_PORT, GATEWAY_HTTP_PORT, PLANNER_PORT = 50051, 8000, 50052
WORKER_PORT, UCX_PORT, METRICS_PORT = 50061, 50062, 9100
# UCX's TCP transport listens on a port of this range (UCX_TCP_PORT_RANGE on worker pods), one
# per rank, so that a NetworkPolicy can name it; its UCP listeners are UCX_PORT + rank.
UCX_TCP_PORTS = (50100, 50163)
HEALTH_PORT = 9101  # under mesh TLS: grpc.health.v1 alone, in plaintext, for the kubelet
ENVOY_ADMIN_PORT = 9901  # Envoy's admin interface, on the pod's 127.0.0.1 only

Ports = list[tuple[str, int]]  # (name, port) of a container, in order


def labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"distserve-{component}",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": "distserve-deploy",
    }


def selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/component": component, "app.kubernetes.io/part-of": PART_OF}


def meta(name: str, component: str, namespace: str) -> dict:
    return {"name": name, "namespace": namespace, "labels": labels(component)}


def deployment(
    name: str,
    component: str,
    namespace: str,
    pod: dict,
    *,
    annotations: dict[str, str] | None = None,
    strategy: dict | None = None,
    node_group: str | None = None,
    replicas: int = 1,
) -> dict:
    match = selector(component) | ({NODE_GROUP: node_group} if node_group else {})
    template: dict = {"labels": labels(component) | match}
    if annotations:
        template["annotations"] = annotations
    spec: dict = {"replicas": replicas, "selector": {"matchLabels": match}}
    if strategy is not None:
        spec["strategy"] = strategy
    spec["template"] = {"metadata": template, "spec": pod}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, component, namespace),
        "spec": spec,
    }


def stateful_set(
    name: str,
    component: str,
    namespace: str,
    pod: dict,
    *,
    service: str,
    replicas: int,
    annotations: dict[str, str] | None = None,
) -> dict:
    """Pods with stable names, `<name>-<i>.<service>...` (`service`: a headless Service), all
    started at once (Parallel: none waits for another to be Ready) and replaced one at a time."""
    template: dict = {"labels": labels(component)}
    if annotations:
        template["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(name, component, namespace),
        "spec": {
            "serviceName": service,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(component)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": template, "spec": pod},
        },
    }


def service(
    name: str, component: str, namespace: str, ports: Ports, headless: bool = False
) -> dict:
    """A ClusterIP Service; headless for worker pools: the gateway reaches each worker at the
    pod IP it registered, and the Service is there for DNS discovery and metrics scraping.
    One with a `metrics` port is labelled METRICS_LABEL: what the ServiceMonitor selects."""
    metadata = meta(name, component, namespace)
    if "metrics" in (n for n, _ in ports):
        metadata["labels"][METRICS_LABEL] = "true"
    spec: dict = {
        "selector": selector(component),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": spec,
    }


def disruption_budget(role: str, namespace: str, min_available: int | None = None) -> dict:
    """At most one pod of the pool evicted at a time (node drains, upgrades); or, given
    `min_available`, at least that many pods kept."""
    keep = {"maxUnavailable": 1} if min_available is None else {"minAvailable": min_available}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(f"distserve-{role}", role, namespace),
        "spec": keep | {"selector": {"matchLabels": selector(role)}},
    }


def config_map(name: str, component: str, namespace: str, data: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(name, component, namespace),
        "data": data,
    }


def container(
    name: str,
    image: str,
    pull_policy: str,
    command: list[str],
    args: list[str],
    *,
    env: list[dict] | None = None,
    ports: Ports = (),
    probes: dict | None = None,
    resources: dict | None = None,
    mounts: list[dict] | None = None,
) -> dict:
    c: dict = {
        "name": name,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": command,
        "args": args,
    }
    if ports:
        c["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports]
    if env:
        c["env"] = env
    if resources:
        c["resources"] = resources
    if mounts:
        c["volumeMounts"] = mounts
    return c | (probes or {})


def grpc_probes(port: int) -> dict:
    """Kubernetes' own gRPC probes against grpc.health.v1 (the server's overall status, which
    turns NOT_SERVING when a drain starts). Startup allows 10 minutes to load the model."""
    return probes({"grpc": {"port": port}})


def probes(check: dict) -> dict:
    """Startup (10 minutes to load the model), readiness and liveness, all the same check."""
    return {
        "startupProbe": {**check, "periodSeconds": 10, "failureThreshold": 60},
        "readinessProbe": {**check, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**check, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
    }


def from_field(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def from_config(key: str) -> dict:
    return {"name": key, "valueFrom": {"configMapKeyRef": {"name": MESH_CONFIG, "key": key}}}


def digest(data: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
