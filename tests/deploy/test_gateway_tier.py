"""`deploy render --gateway-replicas N` and the mesh's etcd: several gateways behind Envoy,
rolled out without a gap, and a 3-member etcd StatefulSet (or an existing cluster's URLs) that
every worker and gateway reaches by all three members' names, over TLS with its own mesh
certificate under mesh TLS."""

from __future__ import annotations

import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from distserve.deploy.etcd_cluster import etcd_cluster
from distserve.deploy.options import DEFAULT_ETCD_IMAGE, RenderOptions
from distserve.deploy.render import render
from distserve.deploy.secrets import MeshSecrets
from distserve.etcd import etcd_binary
from services.common.errors import InvalidRequest
from tests.deploy.test_render import (
    HERE,
    K8S_VERSIONS,
    args,
    deployments,
    find,
    load,
    objects,
    run_cli,
)

PEERS = "distserve-etcd-peers.distserve.svc.cluster.local"
ETCD_URL = ",".join(f"https://distserve-etcd-{i}.{PEERS}:2379" for i in range(3))
TLS = "/etc/distserve/mesh-tls"  # where a pod mounts its mesh certificate


def _render(**options) -> dict[str, list[dict]]:
    return render(load("plan_high_affinity.json"), RenderOptions(**options))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "options", [{"gateway_replicas": 3}, {"gateway_replicas": 2, "etcd_url": "http://etcd:2379"}]
)
def test_gateway_replicas_and_the_etcd_validate_strictly(options, version):
    for obj in objects(_render(**options)):
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gateways_roll_out_one_more_first_and_keep_all_but_one_through_evictions(n):
    manifests = _render(gateway_replicas=n)
    (gateway,) = deployments(manifests, "gateway")
    assert gateway["spec"]["replicas"] == n
    assert gateway["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    budgets = [o for o in manifests["gateway.yaml"] if o["kind"] == "PodDisruptionBudget"]
    if n == 1:
        assert budgets == []  # a budget of 0 would only block node drains
    else:
        (budget,) = budgets
        assert budget["spec"]["minAvailable"] == n - 1
        selector = budget["spec"]["selector"]["matchLabels"].items()
        assert selector <= gateway["spec"]["template"]["metadata"]["labels"].items()
    # Headless: Envoy's STRICT_DNS cluster resolves every gateway pod, so it balances over them
    # and retries an unanswered request on another one.
    assert find(manifests, "Service", "distserve-gateway")["spec"]["clusterIP"] == "None"


def test_the_etcd_is_a_three_member_statefulset_behind_a_peer_and_a_client_service():
    manifests = _render()
    assert "etcd.yaml" in manifests["kustomization.yaml"][0]["resources"]
    sts = find(manifests, "StatefulSet", "distserve-etcd")
    spec = sts["spec"]
    assert (spec["replicas"], spec["serviceName"]) == (3, "distserve-etcd-peers")
    (c,) = spec["template"]["spec"]["containers"]
    assert c["image"] == DEFAULT_ETCD_IMAGE
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/var/lib/etcd"} in c["volumeMounts"]
    flags = dict(a.split("=", 1) for a in c["args"])
    assert flags["--data-dir"] == "/var/lib/etcd"
    # Clients speak TLS with a certificate of the mesh's CA; the member's is the etcd's own.
    assert flags["--listen-client-urls"] == "https://0.0.0.0:2379"
    assert flags["--advertise-client-urls"] == f"https://$(POD_NAME).{PEERS}:2379"
    assert (flags["--cert-file"], flags["--key-file"]) == (f"{TLS}/tls.crt", f"{TLS}/tls.key")
    assert (flags["--trusted-ca-file"], flags["--client-cert-auth"]) == (f"{TLS}/ca.crt", "true")
    (volume,) = spec["template"]["spec"]["volumes"]
    assert volume["secret"]["secretName"] == "distserve-mesh-tls-etcd"
    assert {"name": volume["name"], "mountPath": TLS, "readOnly": True} in c["volumeMounts"]
    secrets = [o["metadata"]["name"] for o in manifests["secrets.yaml"]]
    assert "distserve-mesh-tls-etcd" in secrets
    # Every member's peer URL is its StatefulSet pod's name under the headless peer Service.
    members = [f"distserve-etcd-{i}" for i in range(3)]
    assert flags["--initial-cluster"] == ",".join(f"{m}=http://{m}.{PEERS}:2380" for m in members)
    assert flags["--initial-advertise-peer-urls"] == f"http://$(POD_NAME).{PEERS}:2380"
    assert flags["--name"] == "$(POD_NAME)"
    assert c["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    peers = find(manifests, "Service", "distserve-etcd-peers")["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    client = find(manifests, "Service", "distserve-etcd")["spec"]
    assert "clusterIP" not in client and [p["port"] for p in client["ports"]] == [2379]
    labels = spec["template"]["metadata"]["labels"].items()
    for selector in (peers["selector"], client["selector"], spec["selector"]["matchLabels"]):
        assert selector.items() <= labels
    budget = find(manifests, "PodDisruptionBudget", "distserve-etcd")["spec"]
    assert budget["minAvailable"] == 2  # a quorum of 3 survives one eviction, never two
    # Liveness asks the member alone (a member waiting for its peers is not dead); readiness
    # asks for the quorum's answer.
    assert c["livenessProbe"]["httpGet"]["path"] == "/health?serializable=true"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    # Every worker and gateway is given all three members (it fails over between them) and
    # presents its own mesh certificate, checking the name every mesh certificate carries.
    for component in ("gateway", "prefill", "decode"):
        flags = args(deployments(manifests, component)[0], manifests)
        assert flags["--etcd"] == ETCD_URL
        assert (flags["--etcd-ca"], flags["--etcd-cert"], flags["--etcd-key"]) == (
            f"{TLS}/ca.crt",
            f"{TLS}/tls.crt",
            f"{TLS}/tls.key",
        )
        assert flags["--etcd-server-name"] == "distserve.internal"


def test_without_mesh_tls_the_etcd_and_its_clients_speak_plaintext():
    manifests = _render(mesh_tls=False)
    (c,) = find(manifests, "StatefulSet", "distserve-etcd")["spec"]["template"]["spec"][
        "containers"
    ]
    flags = dict(a.split("=", 1) for a in c["args"])
    assert flags["--listen-client-urls"] == "http://0.0.0.0:2379"
    assert not {"--cert-file", "--client-cert-auth"} & flags.keys()
    for component in ("gateway", "prefill", "decode"):
        flags = args(deployments(manifests, component)[0], manifests)
        assert flags["--etcd"] == ETCD_URL.replace("https://", "http://")
        assert "--etcd-ca" not in flags


def test_the_etcd_binary_of_its_minor_takes_every_rendered_flag():
    """The rendered flags are etcd 3.5's: the local etcd (the same minor) lists each one."""
    (sts, *_) = etcd_cluster(RenderOptions(), MeshSecrets(mesh_tls="distserve-mesh-tls"))
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    usage = subprocess.run(
        [str(etcd_binary()), "--help"], capture_output=True, text=True, timeout=30
    )
    known = set(re.findall(r"^\s+(--[a-z0-9-]+)", usage.stdout + usage.stderr, re.M))
    rendered = {a.split("=", 1)[0] for a in c["args"]}
    assert rendered <= known, rendered - known
    assert DEFAULT_ETCD_IMAGE.startswith("gcr.io/etcd-development/etcd:v3.5.")


def test_an_existing_etcd_renders_none_and_every_process_joins_it():
    members = "http://etcd-0.infra.svc:2379,http://etcd-1.infra.svc:2379"
    manifests = _render(etcd_url=members)
    assert "etcd.yaml" not in manifests
    assert not [o for o in objects(manifests) if o["metadata"]["name"].startswith("distserve-etcd")]
    for component in ("gateway", "prefill", "decode"):
        flags = args(deployments(manifests, component)[0], manifests)
        assert flags["--etcd"] == members and "--etcd-ca" not in flags
        assert "--etcd-prefix" not in flags  # the default: /distserve/


@pytest.mark.parametrize("etcd_url", ["http://etcd.infra.svc:2379", None])
def test_an_etcd_prefix_reaches_every_process_that_joins_the_etcd(etcd_url):
    manifests = _render(etcd_url=etcd_url, etcd_prefix="/distserve/chat/", planner_replicas=2)
    for component in ("gateway", "prefill", "decode"):
        flags = args(deployments(manifests, component)[0], manifests)
        assert flags["--etcd-prefix"] == "/distserve/chat/", component
    [planner] = [o for o in objects(manifests) if o["kind"] == "StatefulSet" and "planner" in
                 o["metadata"]["name"]]  # fmt: skip
    planner_args = planner["spec"]["template"]["spec"]["containers"][0]["args"]
    assert planner_args[planner_args.index("--etcd-prefix") + 1] == "/distserve/chat/"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"etcd_url": "https://etcd:2379"}, "an existing etcd over TLS is not rendered"),
        ({"etcd_url": "http://etcd:2379/v3"}, "--etcd takes http(s)://HOST:PORT"),
        ({"etcd_url": "http://a:2379,ftp://b:2379"}, "--etcd takes http(s)://HOST:PORT"),
        ({"gateway_replicas": 0}, "--gateway-replicas must be >= 1"),
        ({"etcd_prefix": "distserve"}, "--etcd-prefix 'distserve': a key prefix between slashes"),
    ],
)
def test_an_unusable_gateway_count_or_etcd_url_is_refused_by_name(options, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        RenderOptions(**options)


def test_cli_renders_gateway_replicas_and_the_etcd_image(tmp_path):
    out = tmp_path / "k8s"
    done = run_cli(
        "--placement", str(HERE / "plan_high_affinity.json"), "--out", str(out),
        "--gateway-replicas", "3", "--etcd-image", "quay.io/coreos/etcd:v3.5.21",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    gateway = next(yaml.safe_load_all((out / "gateway.yaml").read_text()))
    assert gateway["spec"]["replicas"] == 3
    sts = next(yaml.safe_load_all((out / "etcd.yaml").read_text()))
    assert (
        sts["spec"]["template"]["spec"]["containers"][0]["image"] == "quay.io/coreos/etcd:v3.5.21"
    )
    done = run_cli(
        "--placement", str(HERE / "plan_high_affinity.json"), "--out", str(tmp_path / "x"),
        "--etcd", "https://etcd:2379",
    )  # fmt: skip
    assert done.returncode != 0 and "an existing etcd over TLS is not rendered" in done.stderr
