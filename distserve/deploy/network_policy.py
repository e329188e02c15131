"""NetworkPolicies: who in the cluster may open a connection to which port of the mesh's pods.

Without them every worker's gRPC and UCX port answers any pod of the cluster, so any workload
could pull a prompt's KV or release it. Rendered by default (`--no-network-policies` turns them
off), ingress only:

- `distserve-default-deny` selects every pod of the mesh and allows nothing: a port no rule
  below names is closed.
- one policy per component, allowing exactly its callers (`ALLOWED`, the table the test reads
  the manifests against): Envoy's edge port from anywhere; the gateway's gRPC and HTTP ports
  from Envoy, its gRPC port from the planner too (the workers' loads it reads); the planner's
  from the gateway (the workload it is fed); a worker's gRPC port (its service, its load feed
  and the kvtransfer control contract) from the gateway, and a prefill
  worker's from decode workers too (describe, renew, release, the gRPC KV fallback); the
  prefill pods' KV ports (each rank's UCX listener, UCX_PORT + rank, and UCX's TCP transport,
  UCX_TCP_PORTS) from decode pods only; the decode pods' UCX TCP ports from prefill pods (UCX's
  TCP transport may connect back to the endpoint that called it); the rendered etcd's client
  port from the gateway and the workers (membership: they join and watch it), and from the
  planner when its replicas elect a leader there (`--planner-replicas` > 1: `allowed`), its peer
  port from its own members (etcd_cluster.py; an etcd given by `--etcd URL` is the cluster's own
  affair). The gateway reaches each planner replica's own pod: the planner's policy selects
  every replica.
- every `metrics` port from the namespaces matching `monitoring` (a label selector: Prometheus'
  namespace).

The health port (HEALTH_PORT, under mesh TLS) has no rule: the kubelet's probes come from the
node, which the common CNIs (Calico, Cilium, the cloud providers') let through to the node's
own pods whatever the policies say. Egress is not restricted (the planner calls the Kubernetes
API, the model staging step the Hub).
"""

from __future__ import annotations

from distserve.deploy import etcd_cluster as etcd
from distserve.deploy import objects as k8s
from distserve.deploy.objects import (
    GATEWAY_GRPC_PORT,
    GATEWAY_HTTP_PORT,
    METRICS_PORT,
    PART_OF,
    PLANNER_PORT,
    UCX_PORT,
    UCX_TCP_PORTS,
    WORKER_PORT,
)
from distserve.deploy.options import RenderOptions
from distserve.deploy.pools import WORKER_ROLES, WorkerPool

ANYONE, MONITORING = "anyone", "monitoring"  # callers that are not a component of the mesh

# component -> port name -> the callers allowed (components, ANYONE or MONITORING). A port
# name is a container port's (`ucx`: every rank's UCX listener) or `ucx-tcp` (UCX_TCP_PORTS).
ALLOWED: dict[str, dict[str, frozenset[str]]] = {
    "envoy": {"http": frozenset({ANYONE})},
    "gateway": {
        "grpc": frozenset({"envoy", "planner"}),
        "http": frozenset({"envoy"}),
    },
    "planner": {"grpc": frozenset({"gateway"})},
    "prefill": {
        "grpc": frozenset({"gateway", "decode"}),
        "ucx": frozenset({"decode"}),
        "ucx-tcp": frozenset({"decode"}),
    },
    "decode": {"grpc": frozenset({"gateway"}), "ucx-tcp": frozenset({"prefill"})},
    "colocated": {"grpc": frozenset({"gateway"})},
    "etcd": {"client": frozenset({"gateway", *WORKER_ROLES}), "peer": frozenset({"etcd"})},
}
for _ports in ALLOWED.values():
    _ports["metrics"] = frozenset({MONITORING})
# callers added when the planner's replicas elect their leader on the etcd (planner.py)
ELECTING: dict[str, dict[str, frozenset[str]]] = {"etcd": {"client": frozenset({"planner"})}}


def allowed(o: RenderOptions) -> dict[str, dict[str, frozenset[str]]]:
    """ALLOWED for these options: with ELECTING's callers when the planner's replicas elect."""
    if o.planner_replicas < 2:
        return ALLOWED
    return {
        component: {
            name: callers | ELECTING.get(component, {}).get(name, frozenset())
            for name, callers in ports.items()
        }
        for component, ports in ALLOWED.items()
    }


def network_policies(
    o: RenderOptions, components: list[str], pools: list[WorkerPool]
) -> list[dict]:
    """The default deny and one policy per rendered component (`components`: those with pods)."""
    namespace, monitoring = o.namespace, o.monitoring_namespace
    tp = max((p.tp for p in pools if p.role == "prefill"), default=1)
    everyone = {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": PART_OF}}}
    deny = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": k8s.meta("distserve-default-deny", "network", namespace),
        "spec": {**everyone, "policyTypes": ["Ingress"]},
    }
    policies, table = [deny], allowed(o)
    for component in components:
        rules = []
        for name, callers in table[component].items():
            port, end = _port(component, name, o.edge_port, tp)
            where = {"protocol": "TCP", "port": port} | ({"endPort": end} if end else {})
            rule: dict = {"ports": [where]}
            if ANYONE not in callers:  # a rule without `from` admits every source
                rule["from"] = [_peer(c, monitoring) for c in sorted(callers)]
            rules.append(rule)
        policies.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": k8s.meta(f"distserve-{component}", "network", namespace),
                "spec": {
                    "podSelector": {"matchLabels": k8s.selector(component)},
                    "policyTypes": ["Ingress"],
                    "ingress": rules,
                },
            }
        )
    return policies


def _port(component: str, name: str, edge_port: int, tp: int) -> tuple[int, int | None]:
    """(first port, last port or None) of a port name of ALLOWED on a component's pods."""
    if name == "http":
        return edge_port if component == "envoy" else GATEWAY_HTTP_PORT, None
    if name == "grpc":
        return {"gateway": GATEWAY_GRPC_PORT, "planner": PLANNER_PORT}.get(
            component, WORKER_PORT
        ), None
    if name == "ucx":  # rank r of a pod listens on UCX_PORT + r
        return UCX_PORT, UCX_PORT + tp - 1 if tp > 1 else None
    if name == "ucx-tcp":
        return UCX_TCP_PORTS
    if component == "etcd":
        ports = {"client": etcd.CLIENT_PORT, "peer": etcd.PEER_PORT}
        return ports.get(name, etcd.METRICS_PORT), None
    return METRICS_PORT, None


def _peer(caller: str, monitoring: dict[str, str]) -> dict:
    """A NetworkPolicyPeer: a component's pods in this namespace, or Prometheus' namespaces."""
    if caller == MONITORING:
        return {"namespaceSelector": {"matchLabels": dict(monitoring)}}
    return {"podSelector": {"matchLabels": k8s.selector(caller)}}
