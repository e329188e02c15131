"""`distserve deploy render`: Kubernetes manifests from real planner placements.

The fixtures are `distserve plan` output, stored (a search takes seconds to minutes):
  plan_high_affinity.json    --model-spec opt-66b --cluster 2x8 --workload code --slo 400,100
                             --num-requests 300 --affinity high
  plan_low_affinity.json     --model-spec opt-13b --cluster 2x8,300,3.1 --workload code
                             --slo 250,100 --num-requests 300 --affinity low
  plan_low_affinity_pp2.json --model-spec opt-66b --cluster 2x4,300,3.1 --workload code
                             --slo 400,100 --num-requests 300 --affinity low --max-pp 0
(the last one a what-if with pipeline parallelism, which the workers do not implement)
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from distserve.deploy.model_volume import ModelSource
from distserve.deploy.objects import GPU, NODE_GROUP
from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from services.common.errors import InvalidRequest
from services.edge.envoy import envoy_binary

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
PART_OF = "app.kubernetes.io/part-of"
WORKLOADS = ("Deployment", "StatefulSet")  # the kinds of pod controllers rendered


def load(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def objects(manifests: dict[str, list[dict]]) -> list[dict]:
    return [o for objs in manifests.values() for o in objs if o["kind"] != "Kustomization"]


def find(manifests: dict[str, list[dict]], kind: str, name: str) -> dict:
    (match,) = [o for o in objects(manifests) if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    return match


def deployments(manifests: dict[str, list[dict]], component: str) -> list[dict]:
    return [
        o
        for o in objects(manifests)
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


def workloads(manifests: dict[str, list[dict]], component: str) -> list[dict]:
    """The component's pod controllers: its Deployments, or its StatefulSet (the planner's)."""
    return [
        o
        for o in objects(manifests)
        if o["kind"] in WORKLOADS
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def args(deployment: dict, manifests: dict[str, list[dict]]) -> dict[str, str]:
    """The container's flags with every $(VAR) resolved as the kubelet would: from the mesh
    ConfigMap, or to the downward-API field path in angle brackets."""
    mesh = find(manifests, "ConfigMap", "distserve-mesh")["data"]
    c = container(deployment)
    env = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in ref:
            assert ref["configMapKeyRef"]["name"] == "distserve-mesh"
            env[e["name"]] = mesh[ref["configMapKeyRef"]["key"]]
        else:
            env[e["name"]] = f"<{ref['fieldRef']['fieldPath']}>"
    resolved = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    flags = resolved[0::2]
    assert all(f.startswith("--") for f in flags), resolved
    return dict(zip(flags, resolved[1::2], strict=True))


@pytest.fixture(scope="module")
def high() -> dict[str, list[dict]]:
    return render(load("plan_high_affinity.json"))


@pytest.fixture(scope="module")
def plain() -> dict[str, list[dict]]:
    """Without mesh TLS (rendered by default: tests/deploy/test_mesh_certs.py)."""
    return render(load("plan_high_affinity.json"), RenderOptions(mesh_tls=False))


@pytest.fixture(scope="module")
def low() -> dict[str, list[dict]]:
    return render(load("plan_low_affinity.json"))


@pytest.mark.parametrize(
    ("plan", "options"),
    [
        ("plan_high_affinity.json", RenderOptions()),
        ("plan_low_affinity.json", RenderOptions()),
        (
            "plan_low_affinity.json",
            RenderOptions(baseline=True, model=ModelSource(host_path="/mnt/models"), planner=False),
        ),
    ],
)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_upstream_schema_strictly(plan, options, version):
    manifests = render(load(plan), options)
    for obj in objects(manifests):
        kubernetes_validate.validate(obj, version, strict=True)
    (kustomization,) = manifests["kustomization.yaml"]
    assert kustomization["resources"] == [f for f in manifests if f != "kustomization.yaml"]


def test_strict_validation_rejects_a_misspelt_field(high):
    deployment = json.loads(json.dumps(deployments(high, "prefill")[0]))
    container(deployment)["readinesProbe"] = container(deployment).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_high_affinity_pools_take_replicas_tp_and_gpus_from_the_placement(high):
    # the plan: prefill tp=4 x2, decode tp=4 x2
    (prefill,) = deployments(high, "prefill")
    (decode,) = deployments(high, "decode")
    assert prefill["metadata"]["name"] == "distserve-prefill"
    for d, replicas, tp in ((prefill, 2, 4), (decode, 2, 4)):
        assert d["spec"]["replicas"] == replicas
        flags = args(d, high)
        assert flags["--tensor-parallel-size"] == str(tp)
        assert container(d)["resources"]["limits"][GPU] == tp
        assert "affinity" not in d["spec"]["template"]["spec"]
        assert NODE_GROUP not in d["spec"]["template"]["metadata"]["labels"]
    assert args(decode, high)["--role"] == "decode"
    assert "colocated.yaml" not in high


def test_low_affinity_pins_each_pool_to_the_node_the_plan_gave_it(low):
    plan = load("plan_low_affinity.json")
    placed = Counter((i["role"], i["stages"][0]["node"]) for i in plan["placement"]["instances"])
    assert placed == {("prefill", 0): 3, ("decode", 0): 4, ("prefill", 1): 3, ("decode", 1): 4}
    for (role, node), count in placed.items():
        d = find(low, "Deployment", f"distserve-{role}-node{node}")
        assert d["spec"]["replicas"] == count
        pod = d["spec"]["template"]
        assert pod["metadata"]["labels"][NODE_GROUP] == f"node-{node}"
        assert d["spec"]["selector"]["matchLabels"][NODE_GROUP] == f"node-{node}"
        required = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert required["nodeSelectorTerms"] == [
            {
                "matchExpressions": [
                    {"key": NODE_GROUP, "operator": "In", "values": [f"node-{node}"]}
                ]
            }
        ]
        assert args(d, low)["--tensor-parallel-size"] == "1"
        assert container(d)["resources"]["limits"][GPU] == 1
    for role, total in (("prefill", 6), ("decode", 8)):
        assert sum(d["spec"]["replicas"] for d in deployments(low, role)) == total


def test_workers_and_the_gateway_join_the_mesh_etcd_and_workers_advertise_their_pod_ip(high, low):
    peers = "distserve-etcd-peers.distserve.svc.cluster.local"
    etcd = ",".join(f"https://distserve-etcd-{i}.{peers}:2379" for i in range(3))  # each member
    for manifests in (high, low):
        assert args(deployments(manifests, "gateway")[0], manifests)["--etcd"] == etcd
        for role in ("prefill", "decode"):
            for d in deployments(manifests, role):
                flags = args(d, manifests)
                assert flags["--etcd"] == etcd
                assert flags["--host"] == "<status.podIP>"
                assert flags["--worker-id"] == "<metadata.name>"
                assert flags["--model"] == "/models/model"


def test_every_grpc_server_has_native_grpc_probes_on_its_grpc_port(plain):
    for component in ("gateway", "planner", "prefill", "decode"):
        assert workloads(plain, component), component
        for d in workloads(plain, component):
            c = container(d)
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"] == {"port": port}, (component, probe)
            # Without mesh TLS the gRPC port is probed as it is: no plaintext health port.
            assert "--health-port" not in c["args"]
            assert all(p["name"] != "health" for p in c["ports"])
    envoy = container(deployments(plain, "envoy")[0])
    health = {"path": "/health", "port": 8080, "scheme": "HTTP"}
    assert envoy["readinessProbe"]["httpGet"] == health  # the gateway's, through Envoy
    assert envoy["livenessProbe"]["tcpSocket"] == {"port": 8080}


def test_workers_drain_on_sigterm_within_the_grace_period_without_surge(high):
    for role in ("prefill", "decode"):
        (d,) = deployments(high, role)
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
        assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    custom = render(load("plan_high_affinity.json"), RenderOptions(termination_grace_s=300))
    spec = deployments(custom, "decode")[0]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 300


def test_each_worker_pool_has_a_disruption_budget_of_one_pod(low):
    pools = low["prefill.yaml"] + low["decode.yaml"]
    budgets = [o for o in pools if o["kind"] == "PodDisruptionBudget"]
    assert sorted(b["metadata"]["name"] for b in budgets) == [
        "distserve-decode",
        "distserve-prefill",
    ]
    for b in budgets:
        assert b["spec"]["maxUnavailable"] == 1
        role = b["metadata"]["labels"]["app.kubernetes.io/component"]
        selector = b["spec"]["selector"]["matchLabels"].items()
        covered = deployments(low, role)
        assert len(covered) == 2  # one per node group, both under the pool's budget
        for d in covered:
            assert selector <= d["spec"]["template"]["metadata"]["labels"].items()


def edge_bootstrap(manifests: dict[str, list[dict]], tmp_path: Path) -> dict:
    """Run the Envoy pod's config step as the kubelet would, here: its command and arguments,
    its environment, and its volumes as folders (a Secret's keys as files), every mount path
    moved under tmp_path. Returns the bootstrap it wrote, after `envoy --mode validate`."""
    pod = deployments(manifests, "envoy")[0]["spec"]["template"]["spec"]
    (step,) = pod["initContainers"]
    secrets = {o["metadata"]["name"]: o for o in objects(manifests) if o["kind"] == "Secret"}
    folders = {}
    for volume in pod["volumes"]:
        folder = tmp_path / "volumes" / volume["name"]
        folder.mkdir(parents=True)
        if "secret" in volume:
            for key, value in secrets[volume["secret"]["secretName"]]["data"].items():
                (folder / key).write_bytes(base64.b64decode(value))
        folders[volume["name"]] = folder
    moves = {m["mountPath"]: str(folders[m["name"]]) for m in step["volumeMounts"]}

    def moved(s: str) -> str:
        for path, folder in moves.items():
            s = s.replace(path, folder)
        return s

    env = {e["name"]: moved(e["value"]) for e in step.get("env", [])}
    env |= {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [moved(a) for a in step["command"] + step["args"]],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (envoy,) = pod["containers"]
    config = moved(envoy["args"][envoy["args"].index("--config-path") + 1])
    check = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", config],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-2000:]
    return json.loads(Path(config).read_text())


def test_envoy_bootstrap_is_valid_and_points_at_the_gateway_service(plain, tmp_path):
    bootstrap = edge_bootstrap(plain, tmp_path)
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": 8080}
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for name, port in (("gateway_grpc", 50051), ("gateway_http", 8000)):
        cluster = clusters[name]
        assert cluster["type"] == "STRICT_DNS"
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert endpoint["endpoint"]["address"]["socket_address"] == {
            "address": "distserve-gateway.distserve.svc.cluster.local",
            "port_value": port,
        }
        assert "transport_socket" not in cluster  # no mesh TLS asked
    service_ports = {
        p["port"] for p in find(plain, "Service", "distserve-gateway")["spec"]["ports"]
    }
    assert {50051, 8000} <= service_ports
    envoy = deployments(plain, "envoy")[0]["spec"]["template"]["spec"]
    assert envoy["volumes"] == [
        {"name": "envoy", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}
    ]


def test_the_gateway_takes_the_plans_slos_and_feeds_the_planner(high):
    flags = args(deployments(high, "gateway")[0], high)
    assert (flags["--slo-ttft-ms"], flags["--slo-tpot-ms"]) == ("400", "100")
    # the one planner replica, by its StatefulSet pod's own name (tests/deploy/test_planner.py)
    host = "distserve-planner-0.distserve-planner.distserve.svc.cluster.local"
    assert flags["--planner"] == f"{host}:50052"
    planner = args(find(high, "StatefulSet", "distserve-planner"), high)
    assert planner["--cluster"] == "2x8,300,3.125"
    mesh = find(high, "ConfigMap", "distserve-mesh")["data"]
    assert json.loads(mesh["plan.json"]) == load("plan_high_affinity.json")


def test_every_object_carries_the_recommended_labels(low):
    for o in objects(low):
        if o["kind"] == "Namespace":
            continue
        labels = o["metadata"]["labels"]
        assert labels[PART_OF] == "distserve"
        component = labels["app.kubernetes.io/component"]
        assert labels["app.kubernetes.io/name"] == f"distserve-{component}"
        assert o["metadata"]["namespace"] == "distserve"


def test_the_colocated_baseline_renders_one_colocated_pool():
    m = render(load("plan_low_affinity.json"), RenderOptions(baseline=True))
    (d,) = deployments(m, "colocated")  # the baseline: tp=1 x16
    assert d["spec"]["replicas"] == 16
    assert args(d, m)["--role"] == "colocated"
    assert args(d, m)["--tensor-parallel-size"] == "1"
    assert container(d)["resources"]["limits"][GPU] == 1
    assert "affinity" not in d["spec"]["template"]["spec"]
    assert not deployments(m, "prefill") and not deployments(m, "decode")


def test_a_placement_that_cannot_run_as_pods_is_refused_with_the_reason():
    with pytest.raises(InvalidRequest, match=r"pp=2\): the workers implement tensor paral"):
        render(load("plan_low_affinity_pp2.json"))
    # that plan's colocated baseline is tp=4 pp=2: 8 GPUs, a node has 4
    with pytest.raises(InvalidRequest, match="needs 8 GPUs in one pod, more than a node's 4"):
        render(load("plan_low_affinity_pp2.json"), RenderOptions(baseline=True))


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.cli", "deploy", "render", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_writes_the_kustomization_and_its_resources(tmp_path):
    out = tmp_path / "k8s"
    done = run_cli(
        "--placement", str(HERE / "plan_low_affinity.json"), "--out", str(out),
        "--namespace", "llm", "--model-host-path", "/mnt/models", "--image", "reg.example/ds:1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{NODE_GROUP}=node-0" in done.stdout and f"{NODE_GROUP}=node-1" in done.stdout
    (kustomization,) = yaml.safe_load_all((out / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "llm"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*kustomization["resources"], "kustomization.yaml"]
    )
    assert {"prefill.yaml", "decode.yaml", "gateway.yaml", "envoy.yaml"} <= set(
        kustomization["resources"]
    )
    kinds = Counter()
    for name in kustomization["resources"]:
        for obj in yaml.safe_load_all((out / name).read_text()):
            kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
            assert obj["metadata"].get("namespace", "llm") == "llm"
            kinds[obj["kind"]] += 1
            if obj["kind"] in WORKLOADS and obj["metadata"]["name"] != "distserve-etcd":
                assert container(obj)["image"] == "reg.example/ds:1"
    assert kinds == {
        "Namespace": 1, "ConfigMap": 1, "Deployment": 6, "Service": 8, "PodDisruptionBudget": 3,
        "StatefulSet": 2, "NetworkPolicy": 7, "Secret": 6,  # the generated mesh certificates
    }  # fmt: skip
    decode = yaml.safe_load_all((out / "decode.yaml").read_text())
    volumes = next(decode)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/mnt/models", "type": "Directory"}} in volumes


def test_cli_reports_an_unusable_placement_as_an_error(tmp_path):
    done = run_cli(
        "--placement", str(HERE / "plan_low_affinity_pp2.json"), "--out", str(tmp_path / "k")
    )
    assert done.returncode == 2
    assert "distserve: error: instance 0 (prefill, tp=2, pp=2)" in done.stderr
    assert not (tmp_path / "k").exists()


def test_cli_passes_each_pools_and_the_gateways_own_options_into_their_containers(tmp_path):
    out = tmp_path / "k8s"
    done = run_cli(
        "--placement", str(HERE / "plan_high_affinity.json"), "--out", str(out),
        "--worker-args", "--max-num-seqs 32",
        "--prefill-args", "--max-batch-tokens 4096 --kv-cache-gib 2.5",
        "--decode-args", "--gpu-memory-utilization 0.85 --max-model-len 8192",
        "--gateway-args", "--local-prefill-max-tokens 64",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifests = {
        name.name: list(yaml.safe_load_all(name.read_text())) for name in out.glob("*.yaml")
    }
    (prefill,) = deployments(manifests, "prefill")
    (decode,) = deployments(manifests, "decode")
    (gateway,) = deployments(manifests, "gateway")
    p, d, g = args(prefill, manifests), args(decode, manifests), args(gateway, manifests)
    assert (p["--max-num-seqs"], p["--max-batch-tokens"], p["--kv-cache-gib"]) == (
        "32",
        "4096",
        "2.5",
    )
    assert "--gpu-memory-utilization" not in p and "--max-model-len" not in p
    assert (d["--max-num-seqs"], d["--gpu-memory-utilization"], d["--max-model-len"]) == (
        "32",
        "0.85",
        "8192",
    )
    assert "--kv-cache-gib" not in d and "--max-batch-tokens" not in d
    assert g["--local-prefill-max-tokens"] == "64" and "--max-num-seqs" not in g
    for obj in objects(manifests):
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--decode-args", "--kv-cache-gb 3", "--decode-args '--kv-cache-gb 3': unrecognized"),
        ("--prefill-args", "--max-model-len x", "argument --max-model-len: invalid int value"),
        ("--worker-args", "--port 7000", "--port is set by the launcher (a pod's ports are fixed)"),
        ("--decode-args", "--tensor-parallel-size 4", "--tensor-parallel-size is set by the"),
        ("--gateway-args", "--metrics-port 1234", "--metrics-port is set by the launcher"),
        ("--worker-args", "--health-port 7001", "--health-port is set by the launcher"),
        ("--gateway-args", "--health-port 7001", "--health-port is set by the launcher"),
        ("--gateway-args", "--bogus 1", "--gateway-args '--bogus 1': unrecognized arguments"),
    ],
)
def test_cli_refuses_options_a_process_does_not_take_or_the_pod_sets(
    tmp_path, flag, value, message
):
    out = tmp_path / "k"
    done = run_cli(
        "--placement", str(HERE / "plan_high_affinity.json"), "--out", str(out), flag, value
    )
    assert done.returncode == 2, done.stdout
    assert message in done.stderr
    assert not out.exists()


def test_the_default_image_is_tagged_with_this_packages_version(high):
    import importlib.metadata

    version = importlib.metadata.version("distserve-mesh")  # pyproject.toml's
    for d in (o for o in objects(high) if o["kind"] in WORKLOADS):
        if d["metadata"]["name"] == "distserve-etcd":
            continue  # etcd's own image
        spec = d["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["image"] == f"distserve-mesh:{version}"
