"""The planner on Kubernetes: `--planner-replicas N` replicas, one leading, the others standing by.

A StatefulSet behind a headless Service, so each replica has a stable address of its own,
`distserve-planner-<i>.distserve-planner.<namespace>.svc.<cluster domain>`: every gateway is
given all of them (`--planner A,B,...`, the mesh ConfigMap's PLANNER_ADDRESS) and feeds each
the whole workload on a stream of its own (services/gateway/planner_feed.py), so a standby's
window is full when it takes over. A Deployment's pods have no such names, and one Service name
for all of them would reach one replica (a gRPC channel picks one address), not each.

With N >= 2 every replica campaigns on the mesh's etcd under one election key
(services/common/election.py), with the etcd options every other client of that etcd gets
(its members' URLs, the mesh certificate under TLS): one leads (replans, and with
`--planner-acts` runs the control loop as the planner's ServiceAccount, which every replica
runs as), the others stand by and take over within the election's lease when it dies, at once
when it stops (it resigns on SIGTERM). One replica does not campaign: alone, it always leads,
and etcd's absence cannot make it stop.

A standby is Ready: its gRPC health is SERVING whatever the election says (it answers Plan and
GetPlacement and takes the workload). Readiness is not leadership (`distserve_planner_leader`
says that): a headless Service publishes only Ready pods' names, so an unready standby would
get no feed and take over with an empty window; a PodDisruptionBudget counts only Ready pods,
so it would block every node drain; and a roll-out waits for each replaced pod to be Ready, so
it would never end. The budget lets one replica go at a time, so a drain or an upgrade never
takes the leader and every standby at once. Roll-outs replace one pod at a time, highest
ordinal first, and a replaced leader resigns: with one replica the old pod is gone before the
new one starts, so two planners never act at once.
"""

from __future__ import annotations

from distserve.deploy import objects as k8s
from distserve.deploy.etcd_cluster import etcd_client_args
from distserve.deploy.objects import METRICS_PORT, PLANNER_PORT
from distserve.deploy.options import RenderOptions
from distserve.deploy.planner_rbac import ACTING_ENV, SERVICE_ACCOUNT, acting_args
from distserve.deploy.pod import MeshPods
from distserve.deploy.pools import WorkerPool
from distserve.deploy.resources import PLANNER, fixed
from services.common.election import DEFAULT_TTL_S

NAME = "distserve-planner"  # the StatefulSet and its headless Service
ELECTION_KEY = "planner"  # the replicas' election on the mesh's etcd


def replica_hosts(o: RenderOptions) -> list[str]:
    """Each replica's own DNS name (its StatefulSet pod's, under the headless Service)."""
    return [
        f"{NAME}-{i}.{NAME}.{o.namespace}.svc.{o.cluster_domain}" for i in range(o.planner_replicas)
    ]


def planner_address(o: RenderOptions) -> str:
    """What the gateways' `--planner` takes: every replica's host:port, comma-separated."""
    return ",".join(f"{host}:{PLANNER_PORT}" for host in replica_hosts(o))


def planner(m: MeshPods, plan: dict, pools: list[WorkerPool], config: dict[str, str]) -> list[dict]:
    """The StatefulSet, its headless Service and, with several replicas, their disruption
    budget. Acting (--planner-acts, planner_rbac.py): as its ServiceAccount, with its control
    loop's flags and the model's config; else it only recommends."""
    o, acts, electing = m.o, m.o.planner_acts, m.o.planner_replicas > 1
    args = ["--host", "0.0.0.0", "--port", str(PLANNER_PORT), "--metrics-port", str(METRICS_PORT)]
    cluster = plan.get("cluster")
    if isinstance(cluster, dict) and {"nodes", "gpus_per_node"} <= cluster.keys():
        spec = f"{cluster['nodes']}x{cluster['gpus_per_node']}"
        if "intra_node_gb_s" in cluster and "inter_node_gb_s" in cluster:
            spec += f",{cluster['intra_node_gb_s']:g},{cluster['inter_node_gb_s']:g}"
        args += ["--cluster", spec]
    args += acting_args(plan, pools, config) if acts else []
    env = [k8s.from_config(key) for key in ACTING_ENV] if acts else m.secrets.mesh_tls_env()
    if electing:
        args += ["--etcd", "$(ETCD_URL)", *etcd_client_args(o, m.secrets)]
        args += ["--election-key", ELECTION_KEY, "--election-ttl-s", f"{DEFAULT_TTL_S:g}"]
        # the leader as standbys name it: this pod's own DNS name, not the 0.0.0.0 it binds
        host = f"$(POD_NAME).{NAME}.{o.namespace}.svc.{o.cluster_domain}"
        args += ["--advertise", f"{host}:{PLANNER_PORT}"]
        env += [k8s.from_config("ETCD_URL"), k8s.from_field("POD_NAME", "metadata.name")]
    health_args, health_ports, probes = m.health(PLANNER_PORT)
    ports = [("grpc", PLANNER_PORT), ("metrics", METRICS_PORT)]
    # the mesh certificate; acting, model_pod mounts it with the model
    volumes, mounts = ([], []) if acts else m.secrets.mesh_tls_volumes("planner")
    container = m.container(
        "planner", ["python", "-m", "services.planner"], args + health_args,
        env=env, ports=ports + health_ports, probes=probes, resources=fixed(PLANNER),
        mounts=mounts,
    )  # fmt: skip
    pod = {"containers": [container]} | ({"volumes": volumes} if volumes else {})
    if acts:  # the model's config too, staged tokenizer-only
        pod = {"serviceAccountName": SERVICE_ACCOUNT} | m.model_pod(
            [container], [], tokenizer_only=True
        )
    n, ns = o.planner_replicas, o.namespace
    sts = k8s.stateful_set(
        NAME, "planner", ns, pod, service=NAME, replicas=n, annotations=m.annotations()
    )
    objects = [sts, k8s.service(NAME, "planner", ns, ports, headless=True)]
    if electing:
        objects.append(k8s.disruption_budget("planner", ns))
    return objects
