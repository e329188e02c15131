"""`deploy render --planner-acts`: the planner's ServiceAccount, a Role granting exactly what
the Kubernetes actuator calls (derived from the calls it makes against tests/planner/k8s_api.py,
a local server standing in for a cluster, not from a list), and the planner's flags."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from services.common.errors import InvalidRequest
from services.planner.k8s_actuator import KubernetesActuator
from tests.deploy.test_render import K8S_VERSIONS, ROOT, args, find, load, objects
from tests.planner.k8s_api import FakeCluster

ACTS = RenderOptions(planner_acts=True)
_PATH = re.compile(r"/apis?/(?:([^/]+)/)?v1/namespaces/[^/]+/([^/]+)(?:/([^/]+)(?:/([^/]+))?)?")


@pytest.fixture(scope="module")
def high() -> dict[str, list[dict]]:
    return render(load("plan_high_affinity.json"), ACTS)


@pytest.mark.parametrize("plan", ["plan_high_affinity.json", "plan_low_affinity.json"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_acting_planners_objects_validate_strictly(plan, version):
    for obj in objects(render(load(plan), ACTS)):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_role_grants_exactly_the_calls_the_actuator_makes(high):
    deployments = [o for o in objects(high) if o["kind"] == "Deployment"]
    cluster = FakeCluster("distserve", deployments)
    try:
        api = client.ApiClient(client.Configuration(host=cluster.url))
        act = KubernetesActuator(api, "distserve", poll_s=0.01)
        act.status()
        act.scale("default", "decode", 3)
        act.apply("default", {"decode": 2, "prefill": 2}, "down again")
        act.drain(cluster.pods_of("distserve-prefill")[0])
        used = {_permission(method, path) for method, path, _, _ in cluster.requests}
    finally:
        cluster.close()
    role = find(high, "Role", "distserve-planner")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == used
    assert ("apps", "deployments/scale", "patch") in used  # replicas only, not the template
    assert all(verb in ("list", "patch") for _, _, verb in used)  # no create, delete, get


def _permission(method: str, path: str) -> tuple[str, str, str]:
    """The RBAC (apiGroup, resource, verb) a request to the API needs."""
    group, resource, name, sub = _PATH.fullmatch(path).groups()
    verb = {"GET": "get" if name else "list", "PATCH": "patch"}[method]
    return group or "", f"{resource}/{sub}" if sub else resource, verb


def test_the_planner_runs_as_its_service_account_bound_in_its_namespace(high):
    binding = find(high, "RoleBinding", "distserve-planner")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "distserve-planner",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "distserve-planner", "namespace": "distserve"}
    ]
    find(high, "ServiceAccount", "distserve-planner")
    planner = find(high, "StatefulSet", "distserve-planner")
    assert planner["spec"]["template"]["spec"]["serviceAccountName"] == "distserve-planner"
    (kustomization,) = high["kustomization.yaml"]
    assert "planner-rbac.yaml" in kustomization["resources"]


def test_the_planners_flags_turn_its_control_loop_on_with_the_kubernetes_actuator(high):
    flags = args(find(high, "StatefulSet", "distserve-planner"), high)
    assert flags["--actuator"] == "kubernetes"
    assert flags["--gateway"] == "distserve-gateway.distserve.svc.cluster.local:50051"
    assert flags["--budget"] == "16"  # the plan's 2x8 cluster
    assert flags["--slo"] == "400,100"  # the plan's SLOs
    assert flags["--tp"] == "prefill=4,decode=4"
    model_dir = find(high, "ConfigMap", "distserve-mesh")["data"]["MODEL_DIR"]
    assert flags["--model-spec"] == model_dir
    pod = find(high, "StatefulSet", "distserve-planner")["spec"]["template"]["spec"]
    (mount,) = [v for v in pod["containers"][0]["volumeMounts"] if v["name"] == "model"]
    assert model_dir.startswith(mount["mountPath"])
    from services.planner.__main__ import parse

    config = parse([a for pair in flags.items() for a in pair])  # the planner takes them
    assert config.autoscale.actuator == "kubernetes" and config.autoscale.config.budget == 16


def test_without_planner_acts_nothing_grants_the_planner_anything():
    manifests = render(load("plan_high_affinity.json"))
    kinds = {o["kind"] for o in objects(manifests)}
    assert not kinds & {"ServiceAccount", "Role", "RoleBinding"}
    planner = find(manifests, "StatefulSet", "distserve-planner")
    assert "serviceAccountName" not in planner["spec"]["template"]["spec"]
    assert "--actuator" not in planner["spec"]["template"]["spec"]["containers"][0]["args"]


def test_what_the_acting_planner_lacks_is_refused_at_render_time():
    with pytest.raises(InvalidRequest, match="--planner-acts needs the planner"):
        RenderOptions(planner_acts=True, planner=False)
    plan = load("plan_high_affinity.json")
    with pytest.raises(InvalidRequest, match="--slo-ttft-ms and --slo-tpot-ms"):
        render({k: v for k, v in plan.items() if k != "slo_ms"}, ACTS)
    with pytest.raises(InvalidRequest, match="names no cluster"):
        render(
            plan["placement"],
            RenderOptions(
                planner_acts=True, model_spec="opt-66b", slo_ttft_ms=400, slo_tpot_ms=100
            ),
        )


def test_cli_renders_the_acting_planner_and_kustomize_builds_it(tmp_path):
    out = tmp_path / "k8s"
    placement = ROOT / "tests/deploy/plan_high_affinity.json"
    cli = [sys.executable, "-m", "distserve.cli", "deploy", "render", "--placement", placement]
    done = subprocess.run(
        [*cli, "--out", out, "--planner-acts"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kinds = [o["kind"] for o in yaml.safe_load_all((out / "planner-rbac.yaml").read_text())]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding"]
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl here: kustomize's build not checked")
    built = subprocess.run(["kubectl", "kustomize", out], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert "kind: RoleBinding" in built.stdout
    done = subprocess.run(
        [*cli, "--out", tmp_path / "x", "--planner-acts", "--no-planner"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--planner-acts needs the planner" in done.stderr
