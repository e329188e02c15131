"""`deploy render`'s NetworkPolicies (distserve/deploy/network_policy.py): every port every pod
declares is reachable by exactly the callers the mesh needs, read off the rendered manifests the
way a CNI reads them (a policy selects pods by label, a rule admits peers by label on ports),
and nothing else of a pod is reachable at all."""

from __future__ import annotations

import kubernetes_validate
import pytest

from distserve.deploy.model_volume import ModelSource
from distserve.deploy.objects import UCX_PORT, UCX_TCP_PORTS
from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from services.common.errors import InvalidRequest
from tests.deploy.test_render import K8S_VERSIONS, load, objects, run_cli

MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring", "team": "obs"}
OTHER_NS = {"kubernetes.io/metadata.name": "tenant-b"}
WORKERS = {"prefill", "decode", "colocated"}

# Who may open a connection to each named port of each component: what the mesh's processes
# call (DESIGN.md), written here independently of network_policy.ALLOWED.
EXPECTED = {
    ("envoy", "http"): {"anyone"},
    ("envoy", "metrics"): {"monitoring"},
    ("gateway", "grpc"): {"envoy", "planner"},
    ("gateway", "http"): {"envoy"},
    ("gateway", "metrics"): {"monitoring"},
    ("planner", "grpc"): {"gateway"},
    ("planner", "metrics"): {"monitoring"},
    ("prefill", "grpc"): {"gateway", "decode"},
    ("prefill", "ucx"): {"decode"},
    ("prefill", "metrics"): {"monitoring"},
    ("decode", "grpc"): {"gateway"},
    ("decode", "metrics"): {"monitoring"},
    ("colocated", "grpc"): {"gateway"},
    ("colocated", "metrics"): {"monitoring"},
    ("etcd", "client"): {"gateway", "prefill", "decode", "colocated"},
    ("etcd", "peer"): {"etcd"},
    ("etcd", "metrics"): {"monitoring"},
}
# health (mesh TLS): the kubelet's probes come from the node, not from a pod; no rule.
for _c in ("gateway", "planner", *WORKERS):
    EXPECTED[(_c, "health")] = set()


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        have = e["key"] in labels
        ok = {
            "In": have and labels[e["key"]] in e.get("values", []),
            "NotIn": not have or labels[e["key"]] not in e.get("values", []),
            "Exists": have,
            "DoesNotExist": not have,
        }[e["operator"]]
        if not ok:
            return False
    return True


def reachable(manifests, pod_labels: dict[str, str], port: int) -> tuple[set[str], int]:
    """Who may reach `port` of a pod with these labels, and through how many policies: the pods
    of the mesh by component, `monitoring` (a pod in the monitoring namespace), `other-ns` (any
    pod of another namespace), `anyone` (a rule without `from`)."""
    pods = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"][
            "template"
        ]["metadata"]["labels"]
        for d in objects(manifests)
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    callers: set[str] = set()
    granting = 0
    for policy in (o for o in objects(manifests) if o["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        if not _matches(spec["podSelector"], pod_labels):
            continue
        granted = False
        for rule in spec.get("ingress", []):
            if not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"]):
                continue
            granted = True
            if "from" not in rule:
                callers.add("anyone")
            for peer in rule.get("from", []):
                assert "ipBlock" not in peer
                if "namespaceSelector" in peer:
                    assert "podSelector" not in peer
                    if _matches(peer["namespaceSelector"], MONITORING_NS):
                        callers.add("monitoring")
                    if _matches(peer["namespaceSelector"], OTHER_NS):
                        callers.add("other-ns")
                    continue
                callers |= {
                    c for c, labels in pods.items() if _matches(peer["podSelector"], labels)
                }
        granting += granted
    return callers, granting


def table(manifests) -> dict[tuple[str, str], set[str]]:
    """(component, declared port name) -> its callers, for every port of every pod; each
    declared port granted by exactly one policy, or by none where no one may call it."""
    out: dict[tuple[str, str], set[str]] = {}
    for d in (o for o in objects(manifests) if o["kind"] in ("Deployment", "StatefulSet")):
        labels = d["spec"]["template"]["metadata"]["labels"]
        component = labels["app.kubernetes.io/component"]
        for c in d["spec"]["template"]["spec"]["containers"]:
            for p in c.get("ports", []):
                callers, granting = reachable(manifests, labels, p["containerPort"])
                assert granting == (1 if callers else 0), (component, p)
                assert out.setdefault((component, p["name"]), callers) == callers
    return out


@pytest.mark.parametrize(
    ("plan", "options"),
    [
        ("plan_high_affinity.json", RenderOptions()),
        ("plan_low_affinity.json", RenderOptions(edge_port=8443)),
        ("plan_low_affinity.json", RenderOptions(baseline=True, planner=False)),
        ("plan_high_affinity.json", RenderOptions(planner_replicas=2)),
        ("plan_low_affinity.json", RenderOptions(planner_replicas=3, planner_acts=True)),
    ],
)
def test_every_declared_port_of_every_pod_is_reachable_by_exactly_its_callers(plan, options):
    m = render(load(plan), options)
    found = table(m)
    components = {c for c, _ in found}
    present = components | {"anyone", "monitoring"}  # callers among the rendered pods
    expected = dict(EXPECTED)
    if options.planner_replicas > 1:  # the replicas elect their leader on the etcd
        expected["etcd", "client"] = EXPECTED["etcd", "client"] | {"planner"}
    assert found == {k: v & present for k, v in expected.items() if k in found}
    for component in components:  # every port of the table that the pod serves is declared
        assert {n for c, n in expected if c == component} - {"health"} <= {
            n for c, n in found if c == component
        }
    for obj in objects(m):
        if obj["kind"] == "NetworkPolicy":
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_a_port_no_rule_names_is_closed_to_everyone():
    m = render(load("plan_high_affinity.json"))
    for component in ("gateway", "prefill", "decode", "envoy", "planner"):
        labels = {
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": "distserve",
        }
        for port in (22, 2379, 6443, 50070, 65535):
            assert reachable(m, labels, port) == (set(), 0), (component, port)


def test_every_kv_port_of_a_prefill_pod_is_open_to_decode_pods_only():
    """Rank r of a tp-4 prefill pod listens on UCX_PORT + r, and UCX's TCP transport on a port
    of UCX_TCP_PORTS (UCX_TCP_PORT_RANGE in the pod): all of them, and no further, reach
    decode pods alone; the decode pods' UCX TCP ports take prefill pods' connections."""
    m = render(load("plan_high_affinity.json"))  # tp 4
    prefill = {"app.kubernetes.io/component": "prefill", "app.kubernetes.io/part-of": "distserve"}
    decode = prefill | {"app.kubernetes.io/component": "decode"}
    for rank in range(4):
        assert reachable(m, prefill, UCX_PORT + rank) == ({"decode"}, 1)
    assert reachable(m, prefill, UCX_PORT + 4) == (set(), 0)
    first, last = UCX_TCP_PORTS
    for port in (first, last):
        assert reachable(m, prefill, port) == ({"decode"}, 1)
        assert reachable(m, decode, port) == ({"prefill"}, 1)
    for port in (first - 1, last + 1):
        assert reachable(m, prefill, port) == (set(), 0)
    for d in (o for o in objects(m) if o["kind"] == "Deployment"):
        if d["metadata"]["labels"]["app.kubernetes.io/component"] in WORKERS:
            (c,) = d["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["UCX_TCP_PORT_RANGE"] == f"{first}-{last}"


def test_the_monitoring_namespace_is_chosen_by_its_label():
    m = render(
        load("plan_high_affinity.json"), RenderOptions(monitoring_namespace_label="team=obs")
    )
    assert table(m)[("gateway", "metrics")] == {"monitoring"}
    m = render(
        load("plan_high_affinity.json"),
        RenderOptions(monitoring_namespace_label="kubernetes.io/metadata.name=tenant-b"),
    )
    assert table(m)[("gateway", "metrics")] == {"other-ns"}
    with pytest.raises(InvalidRequest, match="--monitoring-namespace-label 'monitoring'"):
        RenderOptions(monitoring_namespace_label="monitoring")


def test_no_network_policies_renders_none(tmp_path):
    off = render(load("plan_high_affinity.json"), RenderOptions(network_policies=False))
    assert "network-policies.yaml" not in off
    assert all(o["kind"] != "NetworkPolicy" for o in objects(off))
    out = tmp_path / "k8s"
    common = ("--placement", "tests/deploy/plan_high_affinity.json", "--out")
    done = run_cli(*common, str(out), "--model-host-path", "/m", "--no-network-policies")
    assert done.returncode == 0, done.stderr
    assert not (out / "network-policies.yaml").exists()
    done = run_cli(*common, str(tmp_path / "k2"), "--model-host-path", "/m")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "k2" / "network-policies.yaml").exists()
    model = ModelSource(host_path="/m")
    assert (
        render(load("plan_high_affinity.json"), RenderOptions(model=model))["kustomization.yaml"][
            0
        ]["resources"][-1]
        == "network-policies.yaml"
    )
