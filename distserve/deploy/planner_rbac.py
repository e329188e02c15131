"""`deploy render --planner-acts`: the planner scales and drains the worker Deployments itself
(services/planner/k8s_actuator.py), as the identity of its own ServiceAccount.

The Role grants exactly the calls the actuator makes (its `RULES`: list Deployments, patch their
`scale` subresource, list and patch pods), in the mesh's namespace only: it cannot create or
delete anything, read Secrets, or change a pod template. The planner's pod gets that
ServiceAccount, the flags of its control loop (`--actuator kubernetes`, the budget, the model,
the SLOs, each role's tensor degree) and the model's config (staged tokenizer-only, as for the
gateway) to size instances with.
"""

from __future__ import annotations

from distserve.deploy import objects as k8s
from distserve.deploy.pools import WorkerPool
from services.common.errors import InvalidRequest
from services.planner.k8s_actuator import RULES

SERVICE_ACCOUNT = "distserve-planner"


def planner_rbac(namespace: str) -> list[dict]:
    """The planner's ServiceAccount, its Role (RULES) and the RoleBinding between them."""
    meta = k8s.meta(SERVICE_ACCOUNT, "planner", namespace)
    rules = [
        {"apiGroups": [r.group], "resources": [r.resource], "verbs": list(r.verbs)} for r in RULES
    ]
    binding = {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": SERVICE_ACCOUNT,
    }
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": binding,
            "subjects": [subject],
        },
    ]


def acting_args(plan: dict, pools: list[WorkerPool], config: dict[str, str]) -> list[str]:
    """The planner's control-loop flags: the budget is the plan's cluster, the SLOs the mesh's
    (`config`: the mesh ConfigMap's data), the roles and degrees the rendered pools'."""
    cluster = plan.get("cluster")
    if not (isinstance(cluster, dict) and {"nodes", "gpus_per_node"} <= cluster.keys()):
        raise InvalidRequest(
            "--planner-acts: the plan names no cluster (nodes, gpus_per_node), so the planner "
            "has no budget: render a `distserve plan` output"
        )
    if not {"SLO_TTFT_MS", "SLO_TPOT_MS"} <= config.keys():
        raise InvalidRequest(
            "--planner-acts: the planner sizes the mesh for its SLOs; the plan has none: give "
            "--slo-ttft-ms and --slo-tpot-ms"
        )
    degrees: dict[str, int] = {}
    for pool in pools:
        degrees.setdefault(pool.role, pool.tp)
    return [
        "--actuator", "kubernetes", "--gateway", "$(GATEWAY_ADDRESS)",
        "--budget", str(cluster["nodes"] * cluster["gpus_per_node"]),
        "--model-spec", "$(MODEL_DIR)",
        "--slo", f"{config['SLO_TTFT_MS']},{config['SLO_TPOT_MS']}",
        "--tp", ",".join(f"{role}={tp}" for role, tp in degrees.items()),
    ]  # fmt: skip


ACTING_ENV = ("MODEL_DIR", "GATEWAY_ADDRESS")  # what acting_args reads from the mesh ConfigMap
