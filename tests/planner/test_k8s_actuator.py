"""The planner's Kubernetes actuator (services/planner/k8s_actuator.py), driven through the
official Kubernetes client against tests/planner/k8s_api.py: a local HTTP server that stands in
for a cluster (the API paths the actuator uses, its status codes, and the ReplicaSet's choice of
pods), loaded with the Deployments `distserve deploy render` makes for a real placement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes import client

from distserve.deploy.render import render
from services.common.errors import (
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from services.planner.k8s_actuator import DELETION_COST, KubernetesActuator
from tests.planner.k8s_api import FakeCluster

PLANS = Path(__file__).parents[1] / "deploy"
NS = "distserve"


def deployments(plan: str) -> list[dict]:
    manifests = render(json.loads((PLANS / plan).read_text()))
    return [o for objs in manifests.values() for o in objs if o["kind"] == "Deployment"]


@pytest.fixture
def cluster():
    c = FakeCluster(NS, deployments("plan_high_affinity.json"))  # prefill x2, decode x2, tp 4
    yield c
    c.close()


def actuator(cluster: FakeCluster, **kw) -> KubernetesActuator:
    api = client.ApiClient(client.Configuration(host=cluster.url))
    return KubernetesActuator(api, NS, poll_s=0.01, **kw)


def patches(cluster: FakeCluster) -> list[tuple[str, str]]:
    return [(path, kind) for method, path, _, kind in cluster.requests if method == "PATCH"]


def test_status_reports_the_worker_pods_by_role_degree_and_state(cluster):
    status = actuator(cluster).status()
    assert status.count("prefill") == 2 and status.count("decode") == 2
    assert status.tp("prefill") == 4 and status.tp("decode") == 4
    assert {i.name for i in status.instances} == set(
        cluster.pods_of("distserve-prefill") + cluster.pods_of("distserve-decode")
    )
    assert all(i.state == "serving" for i in status.instances)
    assert not status.changing


def test_scale_sets_the_deployments_replicas_and_the_status_follows_the_pods(cluster):
    act = actuator(cluster)
    act.scale("default", "decode", 3)
    assert cluster.deployments["distserve-decode"]["spec"]["replicas"] == 3
    assert cluster.deployments["distserve-prefill"]["spec"]["replicas"] == 2
    assert patches(cluster) == [
        (f"/apis/apps/v1/namespaces/{NS}/deployments/distserve-decode/scale", client_merge())
    ]
    status = act.status()
    assert status.changing and status.changes == 1
    assert status.count("decode") == 3
    assert [i.state for i in status.instances if i.role == "decode"].count("starting") == 1
    cluster.ready_all()
    status = act.status()
    assert not status.changing and status.count("decode") == 3


def client_merge() -> str:
    return "application/merge-patch+json"


def test_scale_down_drains_a_not_ready_pod_before_a_serving_one(cluster):
    act = actuator(cluster)
    act.scale("default", "prefill", 3)  # a third prefill pod, not ready yet
    (new,) = set(cluster.pods_of("distserve-prefill")) - {
        i.name for i in act.status().instances if i.state == "serving"
    }
    act.apply("default", {"prefill": 2}, "test")
    draining = [i.name for i in act.status().instances if i.state == "draining"]
    assert draining == [new]
    assert act.status().changing


def test_drain_removes_exactly_the_pod_named_and_one_replica(cluster):
    act = actuator(cluster)
    act.scale("default", "prefill", 3)
    cluster.ready_all()
    first, middle, last = cluster.pods_of("distserve-prefill")
    act.drain(middle)  # not the newest, which the ReplicaSet would remove by default
    assert cluster.pods_of("distserve-prefill") == [first, last]
    assert cluster.deployments["distserve-prefill"]["spec"]["replicas"] == 2
    annotate, scale = patches(cluster)[-2:]
    assert annotate == (f"/api/v1/namespaces/{NS}/pods/{middle}", client_merge())
    assert scale[1] == "application/json-patch+json"  # tests the count, then lowers it
    assert not act.status().changing


def test_drain_of_a_pod_that_is_not_a_worker_is_not_found(cluster):
    with pytest.raises(NotFound, match="no worker pod named 'distserve-gateway-1'"):
        actuator(cluster).drain("distserve-gateway-1")
    assert patches(cluster) == []


def test_a_drain_racing_another_change_fails_instead_of_removing_two(cluster):
    act = actuator(cluster)
    pod = cluster.pods_of("distserve-decode")[0]

    def someone_else(method: str, path: str) -> None:
        if path.endswith("/scale"):  # between the actuator's read and its patch
            cluster.deployments["distserve-decode"]["spec"]["replicas"] = 1

    cluster.before = someone_else
    with pytest.raises(FailedPrecondition, match="changed meanwhile"):
        act.drain(pod)
    assert cluster.deployments["distserve-decode"]["spec"]["replicas"] == 1
    assert "FailedPrecondition" in act.status().last_error


def test_rbac_refusal_is_a_permission_error_naming_the_call_and_the_role(cluster):
    cluster.forbidden.add(("patch", "pods"))
    act = actuator(cluster)
    with pytest.raises(PermissionDenied, match=r"refused to patch pods .*403.*--planner-acts"):
        act.drain(cluster.pods_of("distserve-decode")[0])
    assert cluster.deployments["distserve-decode"]["spec"]["replicas"] == 2
    cluster.forbidden.add(("list", "pods"))
    with pytest.raises(PermissionDenied, match="list pods"):
        act.status()


def test_a_deployment_gone_from_the_api_is_not_found(cluster):
    def delete(method: str, path: str) -> None:
        if method == "PATCH":
            cluster.deployments.pop("distserve-decode", None)

    cluster.before = delete
    with pytest.raises(NotFound, match=r"patch deployments/scale.*404"):
        actuator(cluster).scale("default", "decode", 1)


def test_an_unreachable_api_is_unavailable():
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))
    api.configuration.retries = 0
    with pytest.raises(Unavailable, match="unreachable to list deployments"):
        KubernetesActuator(api, NS).status()


def test_what_it_cannot_do_is_refused_by_name(cluster):
    act = actuator(cluster)
    with pytest.raises(InvalidRequest, match="tensor degree 2 asked, the Deployment's is 4"):
        act.apply("default", {"decode": 2}, tp={"decode": 2})
    with pytest.raises(InvalidRequest, match="no colocated Deployment"):
        act.scale("default", "colocated", 1)
    with pytest.raises(InvalidRequest, match="no pool 'gpu-a'"):
        act.scale("gpu-a", "decode", 1)
    with pytest.raises(InvalidRequest, match=">= 0"):
        act.scale("default", "decode", -1)
    assert patches(cluster) == []


def test_a_role_on_node_pinned_deployments_is_refused_not_guessed():
    cluster = FakeCluster(NS, deployments("plan_low_affinity.json"))
    try:
        act = actuator(cluster)
        roles = {i.role for i in act.status().instances}
        role = next(r for r in roles if len(_pools(cluster, r)) > 1)
        with pytest.raises(FailedPrecondition, match="node-pinned Deployments"):
            act.scale("default", role, 1)
        assert patches(cluster) == []
    finally:
        cluster.close()


def _pools(cluster: FakeCluster, role: str) -> list[str]:
    return [n for n in cluster.deployments if n.startswith(f"distserve-{role}-")]


def test_the_drained_pod_carries_the_lowest_deletion_cost(cluster):
    act = actuator(cluster, drain_timeout_s=0.05)
    cluster.grace_lists = 10**6  # it never finishes terminating
    pod = cluster.pods_of("distserve-decode")[1]
    with pytest.raises(FailedPrecondition, match="did not stop"):
        act.drain(pod)
    assert cluster.pods[pod]["metadata"]["annotations"][DELETION_COST] == str(-(2**31))
    assert [i.state for i in act.status().instances if i.name == pod] == ["draining"]


def test_the_planner_selects_it_with_actuator_kubernetes_and_outside_a_cluster_says_so():
    from services.planner.__main__ import actuator as planner_actuator
    from services.planner.__main__ import parse

    loop = ["--budget", "8", "--model-spec", "opt-13b", "--slo", "400,100"]
    config = parse([*loop, "--actuator", "kubernetes", "--gateway", "gw:50051"])
    assert config.autoscale.actuator == "kubernetes" and config.autoscale.gateway == "gw:50051"
    with pytest.raises(FailedPrecondition, match="runs in the cluster"):
        planner_actuator(config.autoscale)  # this machine is no pod: no in-cluster config
    with pytest.raises(InvalidRequest, match="--gateway is for --actuator kubernetes"):
        parse([*loop, "--actuator", "127.0.0.1:1", "--gateway", "gw:1"])


def test_deploy_act_drives_it_from_a_kubeconfig(cluster, tmp_path, capsys):
    from distserve.deploy.cli import main

    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": cluster.url}}],
                "users": [{"name": "me", "user": {}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "me", "namespace": NS}}
                ],
                "current-context": "fake",
            }
        )
    )
    assert main(["deploy", "act", "--kubeconfig", str(kubeconfig), "scale", "decode", "3"]) == 0
    assert cluster.deployments["distserve-decode"]["spec"]["replicas"] == 3
    assert "decode x3 (tp 4), prefill x2 (tp 4); changing" in capsys.readouterr().out
    pod = cluster.pods_of("distserve-prefill")[0]
    assert main(["deploy", "act", "--kubeconfig", str(kubeconfig), "drain", pod]) == 0
    assert pod not in cluster.pods_of("distserve-prefill")
