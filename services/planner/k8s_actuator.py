"""The planner's actuator on Kubernetes: the `Actuator` interface (services/planner/actuator.py)
over the mesh `distserve deploy render` made, through the official Kubernetes client.

A worker pool is a Deployment (distserve/deploy/render.py says why not a StatefulSet), found by
its labels; a role's count is its Deployment's replicas, set through the `scale` subresource, so
the planner can change replica counts and nothing else of a Deployment. `drain(pod)` removes
exactly that pod: it marks it with the lowest `controller.kubernetes.io/pod-deletion-cost`, which
the ReplicaSet removes first, then lowers the replicas by one (a JSON patch that tests the count
first, so a concurrent change fails instead of removing two). The pod gets SIGTERM, the same
drain the local actuator starts (services/worker/announcer.py: deregister at once, finish or
hand off in-flight work, release held KV) within its termination grace period. A scale-down
drains the least busy pods the same way (the gateway's loads when `gateway` is given, else
not-ready and newest first). `status()` reads the pods and Deployments from the API; a change
is under way while a Deployment has not reached its replicas or a pod is terminating.

What it cannot do is refused by name: a tensor degree other than the Deployment's (re-sharding
changes the pod's GPUs: render and apply again), and scaling a role spread over node-pinned
Deployments (low affinity: the plan, not the actuator, chooses nodes). API errors (RBAC's 403,
a 404, a conflict) become the mesh's named errors.

`RULES` lists every call it makes; `deploy render --planner-acts` grants exactly these to the
planner's ServiceAccount (distserve/deploy/planner_rbac.py). One idea in one file (off the
request path): the actuator, then the small readings of API objects it makes (bottom).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import (
    DistServeError,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from services.planner.actuator import ActuatorStatus, Instance

log = logging.getLogger("distserve.actuator")

ROLES = ("prefill", "decode", "colocated")
POOL = "default"  # one mesh per namespace: one pool, named as the control loop names it
PART_OF = "app.kubernetes.io/part-of=distserve"
COMPONENT = "app.kubernetes.io/component"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_COST = -(2**31)  # the lowest an int32 annotation holds: removed before any other pod
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: `verbs` on `resource` of API group `group` ("" is the core group)."""

    group: str
    resource: str
    verbs: tuple[str, ...]


# Every API call this module makes (each `_call` names its verb and resource from here).
RULES = (
    Rule("apps", "deployments", ("list",)),
    Rule("apps", "deployments/scale", ("patch",)),
    Rule("", "pods", ("list", "patch")),
)


class KubernetesActuator:
    """Scales and drains the worker Deployments of one namespace through the Kubernetes API
    (`api`: a `kubernetes.client.ApiClient`; `from_cluster` makes one). `gateway`: the
    gateway's address, for the workers' loads (None: status carries none)."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        gateway: str | None = None,
        drain_timeout_s: float = 660.0,
        poll_s: float = 1.0,
    ) -> None:
        from kubernetes import client

        self.namespace = namespace
        self._apps, self._core = client.AppsV1Api(api), client.CoreV1Api(api)
        self._gateway = gateway
        self._registry = None  # the gateway's channel, opened at the first status
        self.drain_timeout_s, self.poll_s = drain_timeout_s, poll_s
        self._lock = threading.Lock()  # one change at a time
        self._changes = 0
        self._last_error = ""

    @classmethod
    def from_cluster(
        cls,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        gateway: str | None = None,
    ) -> KubernetesActuator:
        """In a pod (no `kubeconfig`): the ServiceAccount's token and namespace; else the
        kubeconfig's current context (namespace: given, the context's, or "distserve")."""
        from kubernetes import client, config

        try:
            if kubeconfig is None:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                api = client.ApiClient(configuration)
                namespace = namespace or SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
            else:
                api = config.new_client_from_config(config_file=kubeconfig)
                _, context = config.list_kube_config_contexts(config_file=kubeconfig)
                namespace = namespace or context["context"].get("namespace") or "distserve"
        except (config.ConfigException, OSError) as e:
            where = f"the kubeconfig {kubeconfig}" if kubeconfig else "a pod's ServiceAccount"
            raise FailedPrecondition(
                f"no Kubernetes API credentials from {where} ({e}): the Kubernetes actuator runs "
                "in the cluster (`deploy render --planner-acts`), or is given a kubeconfig"
            ) from None
        return cls(api, namespace, gateway)

    def scale(self, pool: str, role: str, count: int) -> None:
        self.apply(pool, {role: count})

    def apply(
        self,
        pool: str,
        counts: Mapping[str, int],
        reason: str = "",
        tp: Mapping[str, int] | None = None,
    ) -> None:
        """Set each role's replicas (roles not named keep theirs); the surplus pods drain (the
        least busy first). Returns once the API took the change: `status().changing` says
        when it has landed."""
        _check(pool, counts, tp)
        with self._lock:
            self._changes += 1
            try:
                self._apply(counts, tp or {})
                self._last_error = ""
            except DistServeError as e:
                self._last_error = f"{type(e).__name__}: {e}"
                raise
        log.info("applied %s: %s", dict(counts), reason or "asked")

    def drain(self, worker: str) -> None:
        """Remove the pod `worker` (a worker's id is its pod's name) and lower its Deployment's
        replicas by one; returns once the pod is gone."""
        with self._lock:
            self._changes += 1
            try:
                self._drain(worker)
                self._last_error = ""
            except DistServeError as e:
                self._last_error = f"{type(e).__name__}: {e}"
                raise

    def status(self) -> ActuatorStatus:
        deployments, pods = self._deployments(), self._pods()
        loads = self._loads()
        instances = []
        for pod in pods:
            owner = _owner(pod, deployments)
            instances.append(
                Instance(
                    pod["metadata"]["name"],
                    pod["metadata"]["labels"][COMPONENT],
                    _state(pod),
                    loads.get(pod["metadata"]["name"]),
                    _degree(owner) if owner else 1,
                )
            )
        changing = any(_rolling(d) for d in deployments) or any(
            i.state == "draining" for i in instances
        )
        return ActuatorStatus(
            tuple(sorted(instances, key=lambda i: i.name)),
            changing=changing,
            last_error=self._last_error,
            changes=self._changes,
        )

    def _apply(self, counts: Mapping[str, int], tp: Mapping[str, int]) -> None:
        deployments = self._deployments()
        moves = []  # (deployment, replicas wanted)
        for role, count in counts.items():
            mine = [d for d in deployments if d["metadata"]["labels"].get(COMPONENT) == role]
            if not mine:
                raise InvalidRequest(
                    f"no {role} Deployment in namespace {self.namespace}: the mesh rendered "
                    "there has none (render a placement with that role)"
                )
            if len(mine) > 1:
                names = ", ".join(d["metadata"]["name"] for d in mine)
                raise FailedPrecondition(
                    f"{role} runs in node-pinned Deployments ({names}): the actuator cannot "
                    "choose their nodes; render the new placement and apply it"
                )
            degree = _degree(mine[0])
            if tp.get(role, degree) not in (0, degree):
                raise InvalidRequest(
                    f"{role}: tensor degree {tp[role]} asked, the Deployment's is {degree}; "
                    "re-sharding changes the pods' GPUs: render the placement and apply it"
                )
            moves.append((mine[0], count))
        moves.sort(key=lambda m: m[1] - m[0]["spec"]["replicas"])  # down first, then up
        for deployment, count in moves:
            current = deployment["spec"]["replicas"]
            if count < current:
                for pod in self._least_busy(deployment)[: current - count]:
                    self._mark(pod["metadata"]["name"])
            if count != current:
                self._set_replicas(deployment["metadata"]["name"], count)

    def _drain(self, worker: str) -> None:
        pods = [p for p in self._pods() if p["metadata"]["name"] == worker]
        if not pods:
            raise NotFound(f"no worker pod named {worker!r} in namespace {self.namespace}")
        owner = _owner(pods[0], self._deployments())
        if owner is None:
            raise FailedPrecondition(f"pod {worker!r} belongs to no worker Deployment")
        replicas = owner["spec"]["replicas"]
        self._mark(worker)
        self._set_replicas(owner["metadata"]["name"], replicas - 1, expect=replicas)
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            mine = [p for p in self._pods() if _owner(p, [owner])]
            me = [p for p in mine if p["metadata"]["name"] == worker]
            if not me:
                log.info("drained %s", worker)
                return
            others = [p["metadata"]["name"] for p in mine if _state(p) == "draining"]
            if _state(me[0]) != "draining" and others:
                raise FailedPrecondition(
                    f"the ReplicaSet removed {', '.join(others)} instead of {worker}: is the "
                    f"PodDeletionCost feature gate off? ({DELETION_COST})"
                )
            time.sleep(self.poll_s)
        raise FailedPrecondition(f"{worker} did not stop in {self.drain_timeout_s:g} s")

    def _least_busy(self, deployment: dict) -> list[dict]:
        """The Deployment's pods, the first to drain first: the least busy (the gateway's
        loads); without loads, not-ready before ready; ties: the newest first."""
        loads = self._loads()
        pods = [p for p in self._pods() if _owner(p, [deployment]) and _state(p) != "draining"]
        pods.sort(key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True)
        return sorted(
            pods, key=lambda p: (_busy(loads.get(p["metadata"]["name"])), _state(p) == "serving")
        )

    def _mark(self, pod: str) -> None:
        body = {"metadata": {"annotations": {DELETION_COST: str(LOWEST_COST)}}}
        self._call(
            "patch", "pods", self._core.patch_namespaced_pod, pod, self.namespace, body,
            _content_type=MERGE_PATCH,
        )  # fmt: skip

    def _set_replicas(self, deployment: str, count: int, expect: int | None = None) -> None:
        """Set the replicas; with `expect`, only if they still are that many (409/422 if not)."""
        if count < 0:
            raise FailedPrecondition(f"{deployment} has no pod left to remove")
        body: Any = {"spec": {"replicas": count}}
        kind = MERGE_PATCH
        if expect is not None:
            body = [
                {"op": "test", "path": "/spec/replicas", "value": expect},
                {"op": "replace", "path": "/spec/replicas", "value": count},
            ]
            kind = JSON_PATCH
        log.info("scaling %s to %d", deployment, count)
        self._call(
            "patch", "deployments/scale", self._apps.patch_namespaced_deployment_scale,
            deployment, self.namespace, body, _content_type=kind,
        )  # fmt: skip

    def _deployments(self) -> list[dict]:
        return self._list("deployments", self._apps.list_namespaced_deployment)

    def _pods(self) -> list[dict]:
        return self._list("pods", self._core.list_namespaced_pod)

    def _list(self, resource: str, fn: Callable) -> list[dict]:
        """The worker objects of `resource` (role-labelled, of this mesh), as the API sends them."""
        selector = f"{PART_OF},{COMPONENT} in ({','.join(ROLES)})"
        return self._call("list", resource, fn, self.namespace, label_selector=selector)["items"]

    def _call(self, verb: str, resource: str, fn: Callable, *args, **kwargs) -> Any:
        """One API call (`verb` on `resource`: one of RULES), its errors as the mesh's."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        assert any(verb in r.verbs and r.resource == resource for r in RULES), (verb, resource)
        what = f"{verb} {resource} in namespace {self.namespace}"
        try:
            # The API's JSON as it is (not the client's models: they differ between versions)
            reply = fn(*args, **kwargs, _request_timeout=30, _preload_content=False)
            return json.loads(reply.data)
        except ApiException as e:
            detail = f"{e.status} {e.reason}: {_message(e)}"
            if e.status in (401, 403):
                raise PermissionDenied(
                    f"the Kubernetes API refused to {what} ({detail}); the planner's "
                    "ServiceAccount needs the Role `distserve deploy render --planner-acts` "
                    "renders"
                ) from None
            if e.status == 404:
                raise NotFound(f"{what}: not found ({detail})") from None
            if e.status in (409, 422):
                raise FailedPrecondition(
                    f"{what}: changed meanwhile ({detail}); ask again on the current state"
                ) from None
            raise Unavailable(f"the Kubernetes API could not {what} ({detail})") from None
        except HTTPError as e:
            raise Unavailable(f"the Kubernetes API is unreachable to {what}: {e}") from None

    def _loads(self) -> dict:
        """Each registered worker's last reported load, by worker id (= pod name); {} without a
        gateway or when it does not answer."""
        if self._gateway is None:
            return {}
        import grpc

        from services.common import mesh_tls
        from services.common.gen.distserve.v1 import gateway_pb2, gateway_pb2_grpc

        if self._registry is None:
            self._registry = mesh_tls.channel(self._gateway)
        stub = gateway_pb2_grpc.WorkerRegistryStub(self._registry)
        try:
            workers = stub.ListWorkers(gateway_pb2.ListWorkersRequest(), timeout=5).workers
        except grpc.RpcError as e:
            log.warning("no worker loads from the gateway: %s", e.code().name)
            return {}
        return {w.worker_id: w.load for w in workers}


def _check(pool: str, counts: Mapping[str, int], tp: Mapping[str, int] | None) -> None:
    if pool != POOL:
        raise InvalidRequest(f"no pool {pool!r}: the mesh of a namespace is one pool, {POOL!r}")
    for role, count in counts.items():
        if role not in ROLES:
            raise InvalidRequest(f"no role {role!r}: one of {', '.join(ROLES)}")
        if count < 0:
            raise InvalidRequest(f"{role}: a count of instances is >= 0, got {count}")
    for role in tp or {}:
        if role not in counts:
            raise InvalidRequest(f"a tensor degree for {role}, whose count is not given")


def _owner(pod: dict, deployments: list[dict]) -> dict | None:
    """The Deployment whose selector matches the pod's labels (the most specific one)."""
    labels = pod["metadata"].get("labels") or {}
    matching = [
        d
        for d in deployments
        if d["spec"]["selector"].get("matchLabels", {}).items() <= labels.items()
    ]
    return max(matching, key=lambda d: len(d["spec"]["selector"]["matchLabels"]), default=None)


def _degree(deployment: dict) -> int:
    """The tensor degree of a worker Deployment's pods (its `--tensor-parallel-size`)."""
    args = deployment["spec"]["template"]["spec"]["containers"][0].get("args") or []
    if "--tensor-parallel-size" in args:
        return int(args[args.index("--tensor-parallel-size") + 1])
    return 1


def _state(pod: dict) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "draining"
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return "serving" if ready else "starting"


def _rolling(deployment: dict) -> bool:
    """The Deployment has not reached what its spec asks (replicas, ready, observed)."""
    spec, status = deployment["spec"], deployment.get("status") or {}
    want = spec["replicas"]
    return (
        (status.get("observedGeneration") or 0) < (deployment["metadata"].get("generation") or 0)
        or (status.get("replicas") or 0) != want
        or (status.get("readyReplicas") or 0) != want
        or (status.get("updatedReplicas") or 0) != want
    )


def _busy(load) -> int:
    """Requests an instance holds (a `WorkerLoad`; None: unknown, so none)."""
    if load is None:
        return 0
    return load.running_seqs + load.waiting_seqs + load.pending_pulls + load.held_kv_handles


def _message(e) -> str:
    """The API's own message from an error's Status body (or its raw body)."""
    try:
        return json.loads(e.body).get("message") or e.body
    except (TypeError, ValueError, AttributeError):
        return str(e.body or "")
