"""`distserve deploy act`: the planner's Kubernetes actuator (services/planner/k8s_actuator.py)
driven by hand from a machine whose kubeconfig reaches the cluster: `status`, `scale ROLE N`,
`drain POD`. The same calls an acting planner makes in the cluster, so the same Role suffices
(bench/k8s_live.sh uses it to scale and drain a live mesh)."""

from __future__ import annotations

import argparse
import os


def add_parser(deploy: argparse._SubParsersAction) -> None:
    a = deploy.add_parser(
        "act",
        help="scale or drain a rendered mesh through the Kubernetes API (the planner's actuator)",
        description=__doc__.split("\n\n")[0],
    )
    a.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
    a.add_argument("--namespace", help="default: the context's, else distserve")
    a.add_argument("--gateway", help="the gateway (host:port), for the workers' loads")
    verbs = a.add_subparsers(dest="act_command", required=True)
    verbs.add_parser("status", help="the worker pods by role, degree and state")
    s = verbs.add_parser("scale", help="set a role's replicas (the surplus drains)")
    s.add_argument("role", choices=("prefill", "decode", "colocated"))
    s.add_argument("count", type=int)
    d = verbs.add_parser("drain", help="remove exactly this worker pod, one replica fewer")
    d.add_argument("pod")
    a.set_defaults(func=act_command)


def act_command(args: argparse.Namespace) -> int:
    from kubernetes.config import KUBE_CONFIG_DEFAULT_LOCATION

    from services.planner.k8s_actuator import POOL, KubernetesActuator

    kubeconfig = os.path.expanduser(args.kubeconfig or KUBE_CONFIG_DEFAULT_LOCATION.split(":")[0])
    actuator = KubernetesActuator.from_cluster(args.namespace, kubeconfig, args.gateway)
    if args.act_command == "scale":
        actuator.scale(POOL, args.role, args.count)
    elif args.act_command == "drain":
        actuator.drain(args.pod)
    status = actuator.status()
    for i in status.instances:
        print(f"{i.name}\t{i.role}\ttp={i.tp}\t{i.state}")
    print(f"{status.describe()}; {'changing' if status.changing else 'settled'}")
    return 0
