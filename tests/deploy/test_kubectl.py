"""`kubectl apply --dry-run=client -k` and `kubectl kustomize` on what `distserve deploy render`
writes: the 1x8 and 2x4 placements with every Secret given as files, the planner acting (two
replicas for 2x4) and the ServiceMonitor. kubectl's client dry-run still asks a server which
kinds it serves (its REST mapping) and whether it validates fields; tests/deploy/api_server.py
stands in for a cluster's API server there: the built-in API of the installed Kubernetes client
and the vendored ServiceMonitor CRD, no object (every object is created).

The fixtures are `distserve plan` output:
  plan_1x8.json  --model-spec opt-13b --cluster 1x8 --workload chat --slo 250,100 --num-requests 300
  plan_2x4.json  --model-spec opt-13b --cluster 2x4 --workload chat --slo 250,100 --num-requests 300
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.certs import self_signed
from tests.deploy.api_server import ApiServer
from tests.deploy.test_render import HERE, ROOT

KUBECTL = shutil.which("kubectl")
PLANS = ("plan_1x8.json", "plan_2x4.json")
CREATED = re.compile(r"(\S+)/(\S+) created \(dry run\)")


def kubectl_minor() -> int:
    done = subprocess.run([KUBECTL, "version", "--client", "-o", "json"], capture_output=True)
    return int(re.match(r"\d+", json.loads(done.stdout)["clientVersion"]["minor"]).group())


pytestmark = [
    pytest.mark.skipif(
        KUBECTL is None,
        reason="kubectl is not installed here: `kubectl apply --dry-run=client -k` and "
        "`kubectl kustomize` on the render are not checked (install kubectl 1.27 or newer)",
    ),
    pytest.mark.skipif(
        KUBECTL is not None and kubectl_minor() < 27,
        reason="kubectl is older than 1.27: it validates fields on the client from OpenAPI v2, "
        "which the stand-in API server does not serve",
    ),
]


@pytest.fixture(scope="module")
def api() -> ApiServer:
    crd = yaml.safe_load((HERE / "crds/monitoring.coreos.com_servicemonitors.yaml").read_text())
    server = ApiServer([crd])
    yield server
    server.close()


def render_cli(out: Path, plan: str, *extra: str) -> Path:
    """`deploy render` of `plan` into `out` with the edge's keys, its TLS and HF_TOKEN as files,
    a Hub model staged, the planner acting and the ServiceMonitor."""
    secrets = out.parent / f"{out.name}-secrets"
    secrets.mkdir()
    (secrets / "keys.txt").write_text("sk-first-7f3a9c\n")
    (secrets / "hf_token").write_text("hf_placeholder\n")
    cert, key = self_signed(secrets)
    done = subprocess.run(
        [
            sys.executable, "-m", "distserve.cli", "deploy", "render",
            "--placement", str(HERE / plan), "--out", str(out),
            "--model", "facebook/opt-13b", "--hf-token-file", str(secrets / "hf_token"),
            "--api-key-file", str(secrets / "keys.txt"), "--tls-cert", str(cert),
            "--tls-key", str(key), "--planner-acts", "--service-monitor", *extra,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Each plan rendered; the 2x4 one with two planner replicas (a StatefulSet, a budget)."""
    root = tmp_path_factory.mktemp("render")
    extra = {"plan_2x4.json": ("--planner-replicas", "2")}
    return {
        plan: render_cli(root / plan.removesuffix(".json"), plan, *extra.get(plan, ()))
        for plan in PLANS
    }


def kubectl(api: ApiServer, home: Path, *args: str) -> subprocess.CompletedProcess:
    """kubectl with a kubeconfig naming the stand-in server, its caches under `home`."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    env["KUBECONFIG"] = str(api.kubeconfig(home / "kubeconfig"))
    return subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, timeout=120)


def file_objects(folder: Path) -> list[dict]:
    """The objects of the kustomization's resources, as written."""
    (kustomization,) = yaml.safe_load_all((folder / "kustomization.yaml").read_text())
    return [
        o for f in kustomization["resources"] for o in yaml.safe_load_all((folder / f).read_text())
    ]


def key(obj: dict) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


@pytest.mark.parametrize("plan", PLANS)
def test_client_dry_run_creates_every_rendered_object(api, rendered, tmp_path, plan):
    done = kubectl(api, tmp_path, "apply", "--dry-run=client", "-k", str(rendered[plan]))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    created = Counter(CREATED.fullmatch(line).groups() for line in done.stdout.splitlines())
    resources = {(r.group, r.kind): r for gv in api.by_gv.values() for r in gv}
    expected = Counter()
    for obj in file_objects(rendered[plan]):
        group = obj["apiVersion"].rpartition("/")[0]
        kind, name = obj["kind"].lower(), obj["metadata"]["name"]
        expected[f"{kind}.{group}" if group else kind, name] += 1  # deployment.apps/NAME
        # kubectl asked the cluster for it under the resource discovery named
        path = resources[group, obj["kind"]].item_path()
        path = path.format(namespace=obj["metadata"].get("namespace"), name=name)
        assert ("GET", path) in api.requests
    assert created == expected
    kinds = {k for _, k, _ in map(key, file_objects(rendered[plan]))}
    assert {"Secret", "Role", "RoleBinding", "ServiceAccount", "ServiceMonitor"} <= kinds
    if plan == "plan_2x4.json":  # the planner's replicas and their budget
        assert ("statefulset.apps", "distserve-planner") in created
        assert ("poddisruptionbudget.policy", "distserve-planner") in created


@pytest.mark.parametrize("plan", PLANS)
def test_kustomize_builds_exactly_the_files_objects(api, rendered, tmp_path, plan):
    done = kubectl(api, tmp_path, "kustomize", str(rendered[plan]))
    assert done.returncode == 0, done.stderr
    built = sorted(yaml.safe_load_all(done.stdout), key=key)
    assert built == sorted(file_objects(rendered[plan]), key=key)


def test_a_kind_the_cluster_does_not_serve_fails_the_dry_run(api, tmp_path):
    # cert-manager's kinds, rendered with --cert-manager, on a cluster without its CRDs
    out = render_cli(tmp_path / "cm", PLANS[1], "--cert-manager")
    done = kubectl(api, tmp_path, "apply", "--dry-run=client", "-k", str(out))
    assert done.returncode != 0
    assert 'no matches for kind "Certificate" in version "cert-manager.io/v1"' in done.stderr
    # a misspelt kind
    decode = out / "decode.yaml"
    decode.write_text(decode.read_text().replace("kind: Deployment", "kind: Deploymnet", 1))
    kustomization = (out / "kustomization.yaml").read_text()
    (out / "kustomization.yaml").write_text(kustomization.replace("- mesh-certificates.yaml\n", ""))
    done = kubectl(api, tmp_path, "apply", "--dry-run=client", "-k", str(out))
    assert done.returncode != 0
    assert 'no matches for kind "Deploymnet" in version "apps/v1"' in done.stderr
