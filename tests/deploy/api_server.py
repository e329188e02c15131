"""A local HTTP server that stands in for a cluster's API server as `kubectl apply
--dry-run=client` reads it: the discovery documents (which kinds the cluster serves, under which
resource names, namespaced or not), the OpenAPI v3 documents kubectl consults to decide who
validates fields, and 404 for every object (the cluster is empty, so every object would be
created).

Nothing here is written for our manifests. The built-in API is read from the official
Kubernetes Python client installed beside us (`kubernetes.client.api`, generated from the
Kubernetes OpenAPI of its release): every REST path, method and response type its API classes
call. A resource is served under its stable group versions only (v1, v2: beta APIs are off by
default since Kubernetes 1.24). Custom resources come from CRD files, as the apiextensions
server serves them (tests/deploy/crds: the Prometheus operator's ServiceMonitor). A kind the
render uses that the cluster does not serve therefore fails kubectl's REST mapping, as it would
on a real cluster.

Field validation: kubectl 1.27+ validates fields on the client only when the server's OpenAPI
says the kind's PATCH does not take the `fieldValidation` query parameter; every apiserver
since 1.27 takes it, so a client dry-run leaves fields to the server (cli-runtime's
`paramVerifyingSchema`). The documents served here say what the client's API says: it takes it.
Fields are checked strictly against the upstream schemas by kubernetes-validate
(tests/deploy/test_render.py), not by this dry-run.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import yaml

_SERIALIZE = re.compile(r"def _(\w+)_serialize\(.*?method='(\w+)',\s*resource_path='([^']+)'", re.S)
_RESPONSE = re.compile(r"def (\w+)_with_http_info\(.*?'200': \"(\w+)\"", re.S)
_QUERY = re.compile(r"_query_params\.append\(\('(\w+)'")
_PATH = re.compile(
    r"/(?:api|apis/([^/]+))/(v\d+)/(?:namespaces/\{namespace\}/)?([a-z]+)(/\{name\})?"
)
# V1Deployment; CoreV1Event, where the client's model names would collide
_MODEL_VERSION = re.compile(r"^(?:[A-Z][a-z]+)*V\d+(?:alpha\d+|beta\d+)?")
_OPENAPI_V2_PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
_VERBS = {
    ("POST", False): "create",
    ("DELETE", True): "delete",
    ("DELETE", False): "deletecollection",
    ("GET", True): "get",
    ("GET", False): "list",
    ("PATCH", True): "patch",
    ("PUT", True): "update",
}


@dataclass
class Resource:
    """One resource of a group version, as discovery lists it."""

    group: str
    version: str
    name: str  # the plural, in the REST path
    kind: str = ""
    namespaced: bool = False
    verbs: set[str] = field(default_factory=set)
    short_names: list[str] = field(default_factory=list)
    patch_params: set[str] = field(default_factory=set)  # the PATCH's query parameters

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def discovery(self) -> dict:
        entry = {
            "name": self.name,
            "singularName": self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": sorted(self.verbs),
        }
        return entry | ({"shortNames": self.short_names} if self.short_names else {})

    def item_path(self) -> str:
        prefix = f"/apis/{self.group_version}" if self.group else "/api/v1"
        scope = "/namespaces/{namespace}" if self.namespaced else ""
        return f"{prefix}{scope}/{self.name}/{{name}}"


def builtin_resources() -> list[Resource]:
    """Every stable built-in resource the installed Kubernetes client calls."""
    found: dict[tuple[str, str, str], Resource] = {}
    api = importlib.resources.files("kubernetes.client.api")
    for module in api.iterdir():
        if not re.fullmatch(r"\w+_v\d+_api\.py", module.name):
            continue
        source = module.read_text()
        kinds = dict(_RESPONSE.findall(source))
        starts = [m.start() for m in _SERIALIZE.finditer(source)] + [len(source)]
        for m, end in zip(_SERIALIZE.finditer(source), starts[1:], strict=True):
            name, method, path = m.groups()
            shape = _PATH.fullmatch(path.replace("/watch/", "/"))
            if shape is None:  # subresources, proxies, discovery
                continue
            group, version, plural, item = shape.groups()
            key = (group or "", version, plural)
            r = found.setdefault(key, Resource(*key))
            r.namespaced |= "{namespace}" in path
            r.verbs.add("watch" if "/watch/" in path else _VERBS[(method, bool(item))])
            if method == "GET" and item:
                r.kind = _MODEL_VERSION.sub("", kinds[name])
            if method == "PATCH":
                r.patch_params = set(_QUERY.findall(source, m.start(), end))
    return [r for r in found.values() if r.kind]


def crd_resources(crds: list[dict]) -> list[Resource]:
    """The resources CustomResourceDefinitions add, one per served version."""
    out = []
    for crd in crds:
        names = crd["spec"]["names"]
        for v in crd["spec"]["versions"]:
            if v["served"]:
                out.append(
                    Resource(
                        crd["spec"]["group"], v["name"], names["plural"], names["kind"],
                        crd["spec"]["scope"] == "Namespaced",
                        {"create", "delete", "deletecollection", "get", "list", "patch",
                         "update", "watch"},
                        names.get("shortNames", []), {"fieldValidation", "dryRun"},
                    )
                )  # fmt: skip
    return out


class ApiServer:
    """The built-in API and `crds` (CustomResourceDefinition objects) behind a real HTTP
    listener (`url`); every request is recorded in `requests` as (method, path)."""

    def __init__(self, crds: list[dict]) -> None:
        resources = builtin_resources() + crd_resources(crds)
        self.crds = crds
        self.by_gv: dict[str, list[Resource]] = {}
        for r in sorted(resources, key=lambda r: (r.group, r.version, r.name)):
            self.by_gv.setdefault(r.group_version, []).append(r)
        self.requests: list[tuple[str, str]] = []
        handler = type("Handler", (_Handler,), {"api": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig whose current context is this server."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": {"server": self.url}}],
            "users": [{"name": "local", "user": {}}],
            "contexts": [
                {
                    "name": "local",
                    "context": {"cluster": "local", "user": "local", "namespace": namespace},
                }
            ],
            "current-context": "local",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def document(self, path: str) -> dict | None:
        """The body the API server answers GET `path` with; None: 404."""
        groups: dict[str, list[str]] = {}
        for gv in self.by_gv:
            if "/" in gv:
                group, version = gv.split("/")
                groups.setdefault(group, []).append(version)
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [_group(g, vs) for g, vs in sorted(groups.items())],
            }
        if path.startswith("/apis/") and path[6:] in groups:
            return _group(path[6:], groups[path[6:]]) | {"kind": "APIGroup", "apiVersion": "v1"}
        gv = path.removeprefix("/api/").removeprefix("/apis/")
        if path in ("/api/v1", f"/apis/{gv}") and gv in self.by_gv:
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": gv,
                "resources": [r.discovery() for r in self.by_gv[gv]],
            }
        if path == "/openapi/v3":
            prefix = lambda gv: "api/v1" if gv == "v1" else f"apis/{gv}"  # noqa: E731
            return {
                "paths": {
                    prefix(gv): {"serverRelativeURL": f"/openapi/v3/{prefix(gv)}"}
                    for gv in self.by_gv
                }
            }
        gv = path.removeprefix("/openapi/v3/api/").removeprefix("/openapi/v3/apis/")
        if path.startswith("/openapi/v3/") and gv in self.by_gv:
            return {
                "openapi": "3.0.0",
                "info": {"title": "Kubernetes", "version": "stand-in"},
                "paths": {r.item_path(): {"patch": _patch(r)} for r in self.by_gv[gv]},
            }
        if path == "/apis/apiextensions.k8s.io/v1/customresourcedefinitions":
            return {
                "kind": "CustomResourceDefinitionList",
                "apiVersion": "apiextensions.k8s.io/v1",
                "metadata": {},
                "items": self.crds,
            }
        return None


def _group(name: str, versions: list[str]) -> dict:
    ordered = sorted(versions, key=lambda v: int(v[1:]), reverse=True)
    listed = [{"groupVersion": f"{name}/{v}", "version": v} for v in ordered]
    return {"name": name, "versions": listed, "preferredVersion": listed[0]}


def _patch(r: Resource) -> dict:
    return {
        "x-kubernetes-group-version-kind": {"group": r.group, "version": r.version, "kind": r.kind},
        "parameters": [
            {"name": p, "in": "query", "schema": {"type": "string"}} for p in sorted(r.patch_params)
        ],
    }


class _Handler(BaseHTTPRequestHandler):
    api: ApiServer

    def log_message(self, *_: object) -> None:
        pass

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        self.api.requests.append(("GET", path))
        if path == "/openapi/v2":
            # Read for a kind whose group version the v3 documents lack (one the cluster does
            # not serve), to look its schema up before the REST mapping refuses it: an empty
            # document has none, as a cluster's has none for a kind it does not serve.
            self.send_response(200)
            self.send_header("Content-Type", _OPENAPI_V2_PROTOBUF)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self.api.document(path)
        status = 200 if body is not None else 404
        if body is None:
            body = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "message": f"{path} not found",
                "code": 404,
            }
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
