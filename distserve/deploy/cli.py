"""`distserve deploy render`: Kubernetes manifests from a `distserve plan` placement.

`register(subparsers)` adds `deploy` to the `distserve` parser; `main(argv)` runs it on its own
(`python -m distserve.deploy.cli deploy render ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distserve.command import run
from distserve.role_args import add_role_args, role_args
from services.common.errors import InvalidRequest


def register(sub: argparse._SubParsersAction) -> None:
    """Add `deploy render` and `deploy scale` to a subparsers object, with their `func`."""
    from distserve.deploy.model_volume import DEFAULT_MODEL_PVC
    from distserve.deploy.options import RenderOptions

    d = RenderOptions()
    deploy = sub.add_parser("deploy", help="deploy the mesh on Kubernetes").add_subparsers(
        dest="deploy_command", required=True
    )
    r = deploy.add_parser(
        "render",
        help="write Kubernetes manifests (kustomization.yaml + resources) for a placement",
        description="Render the mesh for a placement as plain YAML for `kubectl apply -k OUT`.",
    )
    r.add_argument("--placement", required=True, type=Path, help="plan.json from `distserve plan`")
    r.add_argument("--out", required=True, type=Path, help="folder to write the manifests to")
    r.add_argument("--namespace", default=d.namespace)
    r.add_argument("--image", default=d.image, help="the mesh's container image")
    r.add_argument("--image-pull-policy", default=d.image_pull_policy)
    m = r.add_argument_group("the model (docs/kubernetes.md#the-model)")
    m.add_argument(
        "--model",
        metavar="ORG/NAME",
        help="a Hugging Face Hub id: each pod first stages it into the model volume "
        "(`distserve model fetch`); without it the volume holds the model already",
    )
    m.add_argument("--revision", help="with --model: branch, tag or commit (default: main)")
    m.add_argument(
        "--model-path",
        default=d.model.path,
        help="the model folder, relative to the model volume (mounted at /models)",
    )
    m.add_argument(
        "--model-pvc",
        help=f"PersistentVolumeClaim holding the model (default {DEFAULT_MODEL_PVC}); with "
        "--model: staged into it (ReadWriteMany) instead of each pod's emptyDir",
    )
    m.add_argument("--model-host-path", help="mount this folder of every node instead of a PVC")
    m.add_argument(
        "--model-spec",
        help="the model the pods are sized for: a preset or a folder with its config.json "
        "(default: the plan's)",
    )
    z = r.add_argument_group("pod sizes (docs/kubernetes.md#requests-and-limits)")
    z.add_argument("--device", choices=("cuda", "cpu"), default=d.device, help="workers' device")
    z.add_argument("--gpu-memory-gib", type=float, default=d.gpu_memory_gib, help="one GPU's")
    z.add_argument("--cpus-per-rank", type=int, default=d.cpus_per_rank, help="cores per rank")
    s_ = r.add_argument_group(
        "secrets (docs/kubernetes.md#secrets): files rendered into secrets.yaml, or existing "
        "Secrets by name"
    )
    s_.add_argument("--api-key-file", type=Path, help="the edge's API keys, one a line")
    s_.add_argument("--api-key-secret", metavar="NAME", help="a Secret with key `api-keys`")
    s_.add_argument("--tls-cert", type=Path, help="the edge's PEM certificate chain")
    s_.add_argument("--tls-key", type=Path, help="its PEM private key")
    s_.add_argument("--tls-secret", metavar="NAME", help="a kubernetes.io/tls Secret")
    s_.add_argument("--mesh-tls-cert", type=Path, help="mesh mTLS: the processes' certificate")
    s_.add_argument("--mesh-tls-key", type=Path, help="its private key")
    s_.add_argument("--mesh-tls-ca", type=Path, help="the mesh's CA certificate")
    s_.add_argument(
        "--mesh-tls-secret", metavar="NAME", help="a Secret with tls.crt, tls.key, ca.crt"
    )
    s_.add_argument(
        "--no-mesh-tls",
        action="store_true",
        help="the mesh's processes talk plaintext (by default: a generated CA and a certificate "
        "per component, or the --mesh-tls-* given)",
    )
    s_.add_argument(
        "--cert-manager",
        action="store_true",
        help="mesh certificates from cert-manager (Issuers, Certificates) instead of generated",
    )
    s_.add_argument("--hf-token-file", type=Path, help="HF_TOKEN for --model (gated models)")
    s_.add_argument("--hf-token-secret", metavar="NAME", help="a Secret with key `token`")
    r.add_argument(
        "--service-monitor",
        action="store_true",
        help="render a ServiceMonitor (needs the Prometheus operator's CRD)",
    )
    r.add_argument("--served-model-name", help="model name in the HTTP API (default: folder)")
    r.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO (default: the plan's)")
    r.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO (default: the plan's)")
    r.add_argument(
        "--baseline",
        action="store_true",
        help="deploy the plan's colocated baseline instead of its placement",
    )
    r.add_argument("--no-planner", action="store_true", help="no planner")
    r.add_argument(
        "--planner-acts",
        action="store_true",
        help="the planner scales and drains the worker Deployments itself (a ServiceAccount "
        "and a least-privilege Role; docs/kubernetes.md#the-planner-acting)",
    )
    r.add_argument(
        "--planner-replicas",
        type=int,
        default=d.planner_replicas,
        help="planner replicas: with several, one leads (elected on the mesh's etcd) and the "
        "others stand by, taking over within the election's lease when it dies",
    )
    r.add_argument(
        "--gateway-replicas",
        type=int,
        default=d.gateway_replicas,
        help="gateways behind Envoy, each seeing the whole mesh through etcd",
    )
    r.add_argument(
        "--etcd",
        metavar="URL[,URL...]",
        help="an existing etcd's client URLs (http://HOST:PORT, comma-separated: every pod is "
        "given them all) for the mesh's membership; default: render a 3-member etcd "
        "StatefulSet (TLS under mesh TLS)",
    )
    r.add_argument("--etcd-image", default=d.etcd_image, help="the rendered etcd's image")
    r.add_argument(
        "--etcd-prefix",
        metavar="/PREFIX/",
        help="where under etcd's keys the mesh keeps its membership and elections (default "
        "/distserve/): each mesh sharing one existing etcd (--etcd) its own",
    )
    n = r.add_argument_group("the network (docs/kubernetes.md#security)")
    n.add_argument(
        "--no-network-policies",
        action="store_true",
        help="render no NetworkPolicies (by default only the mesh's own callers reach its ports)",
    )
    n.add_argument(
        "--monitoring-namespace-label",
        default=d.monitoring_namespace_label,
        metavar="KEY=VALUE",
        help="the label of the namespaces Prometheus scrapes the metrics ports from",
    )
    r.add_argument("--edge-port", type=int, default=d.edge_port, help="Envoy's listener")
    r.add_argument("--edge-replicas", type=int, default=d.edge_replicas)
    r.add_argument(
        "--edge-service-type", default=d.edge_service_type, help="ClusterIP|NodePort|LoadBalancer"
    )
    r.add_argument(
        "--rate-limit", type=int, default=d.rate_limit_rps, help="requests/s per Envoy; 0 off"
    )
    r.add_argument(
        "--termination-grace-s",
        type=int,
        default=d.termination_grace_s,
        help="how long a worker may drain after SIGTERM",
    )
    r.add_argument("--cluster-domain", default=d.cluster_domain)
    add_role_args(r)
    r.set_defaults(func=render_command)
    sc = deploy.add_parser(
        "scale",
        help="replica patches (and kubectl commands) moving a rendered mesh to a new placement",
        description="Write merge patches of the worker Deployments rendered for --placement "
        "that give them the replica counts of --to, and print the kubectl commands that apply "
        "them (scale-downs first). Only replicas change: a placement of other pool shapes "
        "needs `deploy render` again.",
    )
    sc.add_argument("--placement", required=True, type=Path, help="the plan.json deployed now")
    sc.add_argument("--to", required=True, type=Path, help="the plan.json to scale to")
    sc.add_argument("--out", required=True, type=Path, help="folder to write the patches to")
    sc.add_argument("--namespace", default=d.namespace)
    sc.add_argument("--baseline", action="store_true", help="the plans' colocated baselines")
    sc.set_defaults(func=scale_command)
    from distserve.deploy.act import add_parser

    add_parser(deploy)


def render_command(args: argparse.Namespace) -> int:
    from distserve.deploy.model_volume import ModelSource
    from distserve.deploy.objects import NODE_GROUP
    from distserve.deploy.options import RenderOptions
    from distserve.deploy.render import node_groups, render, write
    from distserve.deploy.secrets import SecretFiles

    try:
        plan = json.loads(args.placement.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"cannot read the placement {args.placement}: {e}") from e
    options = RenderOptions(
        namespace=args.namespace,
        image=args.image,
        image_pull_policy=args.image_pull_policy,
        model=ModelSource(
            path=args.model_path,
            hub_id=args.model,
            revision=args.revision,
            pvc=args.model_pvc,
            host_path=args.model_host_path,
        ),
        secrets=SecretFiles(
            api_key_file=args.api_key_file,
            api_key_secret=args.api_key_secret,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_secret=args.tls_secret,
            mesh_tls_cert=args.mesh_tls_cert,
            mesh_tls_key=args.mesh_tls_key,
            mesh_tls_ca=args.mesh_tls_ca,
            mesh_tls_secret=args.mesh_tls_secret,
            hf_token_file=args.hf_token_file,
            hf_token_secret=args.hf_token_secret,
        ),
        model_spec=args.model_spec,
        device=args.device,
        gpu_memory_gib=args.gpu_memory_gib,
        cpus_per_rank=args.cpus_per_rank,
        service_monitor=args.service_monitor,
        served_model_name=args.served_model_name,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        baseline=args.baseline,
        planner=not args.no_planner,
        planner_acts=args.planner_acts,
        planner_replicas=args.planner_replicas,
        mesh_tls=not args.no_mesh_tls,
        cert_manager=args.cert_manager,
        network_policies=not args.no_network_policies,
        monitoring_namespace_label=args.monitoring_namespace_label,
        edge_port=args.edge_port,
        gateway_replicas=args.gateway_replicas,
        etcd_url=args.etcd,
        etcd_image=args.etcd_image,
        etcd_prefix=args.etcd_prefix,
        edge_replicas=args.edge_replicas,
        edge_service_type=args.edge_service_type,
        rate_limit_rps=args.rate_limit,
        termination_grace_s=args.termination_grace_s,
        cluster_domain=args.cluster_domain,
        passed=role_args(args, fixed_ports=True),
    )
    for path in write(render(plan, options), args.out):
        print(f"wrote {path}")
        if path.name == "secrets.yaml":
            print(f"  {path} holds the secrets themselves: do not commit it")
    groups = node_groups(plan, options)
    if groups:
        print("low affinity: label one GPU node per group before applying:")
        for group in groups:
            print(f"  kubectl label node NODE {NODE_GROUP}={group}")
    print(f"apply with: kubectl apply -k {args.out}")
    return 0


def scale_command(args: argparse.Namespace) -> int:
    from distserve.deploy.options import RenderOptions
    from distserve.deploy.scale import ReplicaPatches

    plans = []
    for path in (args.placement, args.to):
        try:
            plans.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise InvalidRequest(f"cannot read the placement {path}: {e}") from e
    options = RenderOptions(namespace=args.namespace, baseline=args.baseline)
    commands = ReplicaPatches(plans[0], args.out, options).apply(plans[1])
    if not commands:
        print("the replica counts already match: nothing to change")
    for command in commands:
        print(command)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run((register,), argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
