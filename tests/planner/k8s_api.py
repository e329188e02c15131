"""A local HTTP server that stands in for a Kubernetes cluster: it speaks the API paths the
planner's Kubernetes actuator uses (list Deployments and pods by label selector, patch a pod,
patch a Deployment's `scale` subresource by merge or JSON patch), with the API's status codes
and `Status` bodies, and plays the ReplicaSet controller: a scale-down marks the pods with the
lowest `pod-deletion-cost` (ties: the newest) terminating, a scale-up creates pods from the
Deployment's template (not ready until `ready_all`), and a terminating pod is gone after
`grace_lists` more pod lists. It records every request as (method, path, query, content type),
so a test can derive the RBAC verbs the actuator needed.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_DEPLOYMENTS = re.compile(r"/apis/apps/v1/namespaces/([^/]+)/deployments(?:/([^/]+)(/scale)?)?")
_PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?")


class FakeCluster:
    """One namespace's Deployments and pods behind a real HTTP listener (`url`)."""

    def __init__(self, namespace: str, deployments: list[dict], grace_lists: int = 1) -> None:
        self.namespace, self.grace_lists = namespace, grace_lists
        self.deployments: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.requests: list[tuple[str, str, dict, str]] = []
        self.forbidden: set[tuple[str, str]] = set()  # (verb, resource) RBAC refuses
        self.before: Callable[[str, str], None] | None = None  # runs before each request
        self._serial = itertools.count(1)
        self._clock = itertools.count(1)
        self._lock = threading.RLock()
        for d in deployments:
            d = copy.deepcopy(d)
            d["metadata"].update(generation=1, uid=f"uid-{next(self._serial)}")
            self.deployments[d["metadata"]["name"]] = d
            for _ in range(d["spec"]["replicas"]):
                self._create_pod(d, ready=True)
            self._settle(d)
        handler = type("Handler", (_Handler,), {"cluster": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def ready_all(self) -> None:
        """Every pod not terminating is ready, and each Deployment's status says so."""
        with self._lock:
            for pod in self.pods.values():
                if "deletionTimestamp" not in pod["metadata"]:
                    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
            for d in self.deployments.values():
                self._settle(d)

    def pods_of(self, deployment: str) -> list[str]:
        with self._lock:
            return sorted(
                n for n, p in self.pods.items() if p["metadata"]["ownerDeployment"] == deployment
            )

    # the controllers

    def _create_pod(self, d: dict, ready: bool) -> None:
        template = d["spec"]["template"]
        name = f"{d['metadata']['name']}-5d8f7c-{next(self._serial):05d}"
        self.pods[name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": dict(template["metadata"]["labels"]),
                "annotations": dict(template["metadata"].get("annotations") or {}),
                "creationTimestamp": f"2025-01-01T00:00:{next(self._clock):02d}Z",
                "ownerDeployment": d["metadata"]["name"],  # stripped when served
            },
            "spec": copy.deepcopy(template["spec"]),
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    def _reconcile(self, d: dict) -> None:
        """The ReplicaSet: as many live pods as the replicas, removing the cheapest first."""
        name, want = d["metadata"]["name"], d["spec"]["replicas"]
        live = [
            p
            for p in self.pods.values()
            if p["metadata"]["ownerDeployment"] == name and "deletionTimestamp" not in p["metadata"]
        ]
        for _ in range(want - len(live)):
            self._create_pod(d, ready=False)
        live.sort(key=lambda p: p["metadata"]["creationTimestamp"], reverse=True)
        live.sort(key=lambda p: int(p["metadata"]["annotations"].get(DELETION_COST, "0")))
        for pod in live[: max(0, len(live) - want)]:
            pod["metadata"]["deletionTimestamp"] = "2025-01-01T01:00:00Z"
            pod["metadata"]["listsLeft"] = self.grace_lists
        self._settle(d, observed=False)

    def _settle(self, d: dict, observed: bool = True) -> None:
        mine = [
            p
            for p in self.pods.values()
            if p["metadata"]["ownerDeployment"] == d["metadata"]["name"]
        ]
        ready = [p for p in mine if p["status"]["conditions"][0]["status"] == "True"]
        generation = d["metadata"]["generation"]
        d["status"] = {
            "observedGeneration": generation if observed else generation - 1,
            "replicas": len(mine),
            "updatedReplicas": len(mine),
            "readyReplicas": len(ready),
            "availableReplicas": len(ready),
        }

    def _age(self) -> None:
        """A pod list: terminating pods come closer to gone; Deployments observe their spec."""
        for name, pod in list(self.pods.items()):
            if "listsLeft" in pod["metadata"]:
                pod["metadata"]["listsLeft"] -= 1
                if pod["metadata"]["listsLeft"] < 0:
                    del self.pods[name]
        for d in self.deployments.values():
            self._settle(d)

    # the API

    def handle(self, method: str, path: str, query: dict, kind: str, body: object) -> tuple:
        if self.before is not None:
            self.before(method, path)
        with self._lock:
            if m := _DEPLOYMENTS.fullmatch(path):
                ns, name, sub = m.groups()
                resource = "deployments/scale" if sub else "deployments"
            elif m := _PODS.fullmatch(path):
                ns, name = m.groups()
                resource, sub = "pods", None
            else:
                return _status(404, "NotFound", f"the server could not find {path}")
            verb = {"GET": "get" if name else "list", "PATCH": "patch"}.get(method, method.lower())
            if (verb, resource) in self.forbidden:
                return _status(
                    403,
                    "Forbidden",
                    f'{resource} is forbidden: User "system:serviceaccount:{ns}:distserve-planner"'
                    f' cannot {verb} resource "{resource}" in the namespace "{ns}"',
                )
            if ns != self.namespace:
                return 200, {"kind": "List", "apiVersion": "v1", "items": []}
            if verb == "list":
                return 200, self._list(resource, query.get("labelSelector", [""])[0])
            if verb != "patch":
                return _status(405, "MethodNotAllowed", f"{method} is not served here")
            return self._patch(resource, name, kind, body)

    def _list(self, resource: str, selector: str) -> dict:
        if resource == "pods":
            self._age()
            items = [_served(p) for p in self.pods.values()]
        else:
            items = list(self.deployments.values())
        kind = "PodList" if resource == "pods" else "DeploymentList"
        items = [i for i in items if _selects(selector, i["metadata"].get("labels") or {})]
        version = "v1" if resource == "pods" else "apps/v1"
        return {"kind": kind, "apiVersion": version, "metadata": {}, "items": items}

    def _patch(self, resource: str, name: str, kind: str, body: object) -> tuple:
        store = self.pods if resource == "pods" else self.deployments
        if name not in store:
            return _status(404, "NotFound", f'{resource.split("/")[0]} "{name}" not found')
        obj = store[name]
        if resource == "pods":
            if kind != "application/merge-patch+json":
                return _status(415, "UnsupportedMediaType", f"{kind} is not merge patch here")
            for key, value in body["metadata"]["annotations"].items():
                obj["metadata"]["annotations"][key] = value
            return 200, _served(obj)
        replicas = obj["spec"]["replicas"]
        if kind == "application/merge-patch+json":
            replicas = body["spec"]["replicas"]
        elif kind == "application/json-patch+json":
            for op in body:
                if op["path"] != "/spec/replicas":
                    return _status(422, "Invalid", f"{op['path']}: a Scale has no such field")
                if op["op"] == "test" and op["value"] != replicas:
                    return _status(422, "Invalid", f"the test operation failed: {replicas}")
                if op["op"] == "replace":
                    replicas = op["value"]
        else:
            return _status(415, "UnsupportedMediaType", f"{kind} is not a patch type here")
        obj["spec"]["replicas"] = replicas
        obj["metadata"]["generation"] += 1
        self._reconcile(obj)
        scale = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"replicas": replicas},
            "status": {"replicas": obj["status"]["replicas"]},
        }
        return 200, scale


class _Handler(BaseHTTPRequestHandler):
    cluster: FakeCluster

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def _serve(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        kind = (self.headers.get("Content-Type") or "").split(";")[0]
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.cluster.requests.append((self.command, url.path, query, kind))
        code, reply = self.cluster.handle(self.command, url.path, query, kind, body)
        data = json.dumps(reply).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _served(pod: dict) -> dict:
    pod = copy.deepcopy(pod)
    pod["metadata"].pop("ownerDeployment")
    pod["metadata"].pop("listsLeft", None)
    return pod


def _status(code: int, reason: str, message: str) -> tuple[int, dict]:
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    return code, status | {"message": message, "reason": reason, "code": code}


def _selects(selector: str, labels: dict[str, str]) -> bool:
    """A label selector of `k=v` and `k in (a,b)` terms (what the actuator sends)."""
    for term in re.findall(r"[^,(]+(?:\([^)]*\))?", selector):
        term = term.strip()
        if m := re.fullmatch(r"(\S+)\s+in\s+\(([^)]*)\)", term):
            if labels.get(m.group(1)) not in m.group(2).split(","):
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term:
            raise ValueError(f"selector term {term!r} not understood")
    return True
