"""`deploy render`'s Secrets (distserve/deploy/secrets.py): the edge's API keys and TLS, the mesh's
mutual TLS and HF_TOKEN, rendered from files or referenced by name, mounted where the processes
read them, and in no other object."""

from __future__ import annotations

import base64
import importlib
import json
import re

import kubernetes_validate
import pytest
import yaml

from distserve.deploy.model_volume import ModelSource
from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from distserve.deploy.secrets import SecretFiles
from services.common.errors import InvalidRequest
from tests.certs import mesh_pki, self_signed
from tests.deploy.test_render import (
    HERE,
    K8S_VERSIONS,
    container,
    edge_bootstrap,
    load,
    objects,
    run_cli,
    workloads,
)  # fmt: skip

KEYS = ("sk-first-7f3a9c", "sk-second-02be11")
TOKEN = "hf_secretTokenValue123"
MESH_PODS = ("gateway", "planner", "envoy", "prefill", "decode")


@pytest.fixture
def files(tmp_path) -> SecretFiles:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# the edge's keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    token = tmp_path / "hf_token"
    token.write_text(TOKEN + "\n")
    cert, key = self_signed(tmp_path)
    mesh_cert, mesh_key, mesh_ca = mesh_pki(tmp_path)
    return SecretFiles(
        api_key_file=keys, tls_cert=cert, tls_key=key, mesh_tls_cert=mesh_cert,
        mesh_tls_key=mesh_key, mesh_tls_ca=mesh_ca, hf_token_file=token,
    )  # fmt: skip


def with_secrets(secrets: SecretFiles) -> dict[str, list[dict]]:
    model = ModelSource(hub_id="org/model")  # staged: HF_TOKEN is used
    return render(load("plan_high_affinity.json"), RenderOptions(secrets=secrets, model=model))


def pod(manifests, component: str) -> dict:
    (w,) = workloads(manifests, component)
    return w["spec"]["template"]["spec"]


def test_secrets_from_files_are_rendered_in_their_own_file_and_valid(files):
    m = with_secrets(files)
    secrets = {s["metadata"]["name"]: s for s in m["secrets.yaml"]}
    assert sorted(secrets) == [
        "distserve-api-keys", "distserve-edge-tls", "distserve-hf-token", "distserve-mesh-tls",
    ]  # fmt: skip
    assert all(o["kind"] != "Secret" for f, objs in m.items() if f != "secrets.yaml" for o in objs)

    def data(name: str, key: str) -> bytes:
        return base64.b64decode(secrets[name]["data"][key])

    assert data("distserve-api-keys", "api-keys") == files.api_key_file.read_bytes()
    assert data("distserve-hf-token", "token") == TOKEN.encode()  # no newline: an env value
    assert secrets["distserve-edge-tls"]["type"] == "kubernetes.io/tls"
    assert data("distserve-edge-tls", "tls.key") == files.tls_key.read_bytes()
    assert data("distserve-mesh-tls", "ca.crt") == files.mesh_tls_ca.read_bytes()
    assert m["kustomization.yaml"][0]["resources"][1] == "secrets.yaml"  # before their users
    for obj in objects(m):
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def test_no_secret_value_appears_in_any_other_object(files):
    m = with_secrets(files)
    others = json.dumps([o for f, objs in m.items() if f != "secrets.yaml" for o in objs])
    values = [*KEYS, TOKEN]
    for path in (files.tls_key, files.mesh_tls_key):
        values += [line for line in path.read_text().splitlines() if "-----" not in line]
    for value in values:
        assert value not in others
        assert base64.b64encode(value.encode()).decode() not in others


def test_envoy_serves_tls_requires_the_keys_and_reaches_the_gateway_over_mesh_tls(files, tmp_path):
    bootstrap = edge_bootstrap(with_secrets(files), tmp_path)  # the pod's own step, then validate
    listeners = {x["name"]: x for x in bootstrap["static_resources"]["listeners"]}
    listener = listeners["edge"]
    (chain,) = listener["filter_chains"]
    tls = chain["transport_socket"]["typed_config"]["common_tls_context"]["tls_certificates"][0]
    assert tls["certificate_chain"]["filename"].endswith("/edge-tls/tls.crt")
    config = json.dumps(listener)
    for key in KEYS:
        assert f"Bearer {key}" in config  # RBAC: the keys of the mounted Secret, each one
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for name in ("gateway_grpc", "gateway_http"):
        upstream = clusters[name]["transport_socket"]["typed_config"]["common_tls_context"]
        assert upstream["validation_context"]["trusted_ca"]["filename"].endswith("/ca.crt")
    envoy = pod(with_secrets(files), "envoy")
    assert envoy["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # Envoy's statistics: in plaintext on the port its pod declares (no key needed); its admin
    # interface on the pod's loopback only.
    stats = listeners["stats"]["address"]["socket_address"]
    declared = {p["name"]: p["containerPort"] for p in envoy["containers"][0]["ports"]}
    assert stats == {"address": "0.0.0.0", "port_value": declared["metrics"]}
    assert "transport_socket" not in listeners["stats"]["filter_chains"][0]
    assert "Bearer" not in json.dumps(listeners["stats"])
    admin = bootstrap["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1" and admin["port_value"] not in declared.values()


def test_every_mesh_process_mounts_the_mesh_certificate_and_is_told_where_it_is(files):
    m = with_secrets(files)
    for component in MESH_PODS:
        spec = pod(m, component)
        (volume,) = [v for v in spec["volumes"] if v["name"] == "mesh-tls"]
        assert volume["secret"]["secretName"] == "distserve-mesh-tls"
        steps = [c for c in spec.get("initContainers", []) if c["name"] == "envoy-config"]
        for c in [*spec["containers"], *steps]:
            folder = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}["mesh-tls"]
            if c["name"] == "envoy":  # Envoy reads the paths its config step wrote
                step = {v["name"]: v["mountPath"] for v in steps[0]["volumeMounts"]}
                assert folder == step["mesh-tls"]
                continue
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["DISTSERVE_TLS_CERT"] == f"{folder}/tls.crt", component
            assert env["DISTSERVE_TLS_KEY"] == f"{folder}/tls.key"
            assert env["DISTSERVE_TLS_CA"] == f"{folder}/ca.crt"


def _parsed(component: str, c: dict, manifests: dict[str, list[dict]]):
    """The container's arguments as its process's own parser reads them, each $(VAR) filled
    from the mesh ConfigMap, or a pod's IP and name."""
    (config,) = [o for o in objects(manifests) if o["kind"] == "ConfigMap"]
    values = config["data"] | {"POD_IP": "10.0.0.7", "POD_NAME": "pod-0"}
    argv = [re.sub(r"\$\((\w+)\)", lambda v: values[v.group(1)], a) for a in c["args"]]
    if component in ("gateway", "planner"):
        return importlib.import_module(f"services.{component}.__main__").parse(argv)
    return importlib.import_module(f"services.{component}.__main__").parse(argv)[0]


def test_under_mesh_tls_the_probes_use_the_plaintext_health_port_of_the_same_process(files):
    """The kubelet's gRPC probe speaks no TLS: each process also serves grpc.health.v1 alone,
    in plaintext, on a port its pod declares (tests/common/test_health_port.py: the same
    statuses as its mTLS server), and the probes go there."""
    m = with_secrets(files)
    for component in ("gateway", "planner", "prefill", "decode"):
        c = container(workloads(m, component)[0])
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": declared["health"]}, component
        assert declared["health"] not in {v for k, v in declared.items() if k != "health"}
        assert _parsed(component, c, m).health_port == declared["health"], component


def test_hf_token_reaches_only_the_model_staging_step(files):
    m = with_secrets(files)
    ref = {"secretKeyRef": {"name": "distserve-hf-token", "key": "token"}}
    for component in ("gateway", "prefill", "decode"):
        spec = pod(m, component)
        (step,) = spec["initContainers"]
        assert {"name": "HF_TOKEN", "valueFrom": ref} in step["env"]
        assert all(e["name"] != "HF_TOKEN" for e in spec["containers"][0]["env"])


def test_secrets_given_by_name_are_mounted_and_not_rendered():
    m = with_secrets(
        SecretFiles(
            api_key_secret="edge-keys",
            tls_secret="edge-cert",
            mesh_tls_secret="mesh-cert",
            hf_token_secret="hub-token",
        )
    )
    assert "secrets.yaml" not in m
    envoy = pod(m, "envoy")
    names = {v["name"]: v["secret"]["secretName"] for v in envoy["volumes"] if "secret" in v}
    assert names == {"edge-tls": "edge-cert", "mesh-tls": "mesh-cert", "api-keys": "edge-keys"}
    step = pod(m, "decode")["initContainers"][0]
    assert step["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "hub-token"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"api_key_file": "missing.txt"}, "cannot read the API key file"),
        ({"hf_token_file": "missing"}, "--hf-token-file: cannot read the secret file"),
        ({"tls_cert": "cert.pem"}, "--tls-cert, --tls-key: give all of them (or --tls-secret)"),
        ({"api_key_file": "keys.txt", "api_key_secret": "k"}, "or --api-key-secret, not both"),
        ({"tls_cert": "keys.txt", "tls_key": "key.pem"}, "keys.txt is not PEM"),
        ({"api_key_file": "empty.txt"}, "holds no key"),
        ({"mesh_tls_secret": "Not_A_Name"}, "--mesh-tls-secret 'Not_A_Name' is not a Secret"),
    ],
)
def test_a_missing_or_wrong_secret_is_refused_at_render_time_by_its_flag(
    files, tmp_path, given, message
):
    (tmp_path / "empty.txt").write_text("# none yet\n")
    paths = {k: v if k.endswith("secret") else tmp_path / v for k, v in given.items()}
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        with_secrets(SecretFiles(**paths))


def test_cli_writes_the_secrets_file_for_its_owner_only_and_says_not_to_commit_it(files, tmp_path):
    out = tmp_path / "k8s"
    done = run_cli(
        "--placement", str(HERE / "plan_high_affinity.json"), "--out", str(out),
        "--api-key-file", str(files.api_key_file), "--tls-cert", str(files.tls_cert),
        "--tls-key", str(files.tls_key), "--hf-token-file", str(files.hf_token_file),
        "--model", "org/model",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "secrets.yaml holds the secrets themselves: do not commit it" in done.stdout
    assert (out / "secrets.yaml").stat().st_mode & 0o777 == 0o600
    kinds = [o["kind"] for o in yaml.safe_load_all((out / "secrets.yaml").read_text())]
    assert kinds == ["Secret"] * (3 + 6)  # given, and a mesh certificate per component (etcd too)
    missing = run_cli(
        "--placement", str(HERE / "plan_high_affinity.json"), "--out", str(tmp_path / "k"),
        "--tls-cert", str(files.tls_cert), "--tls-key", str(tmp_path / "nope.pem"),
    )  # fmt: skip
    assert missing.returncode == 2
    assert "distserve: error: --tls-key: cannot read the secret file" in missing.stderr
    assert not (tmp_path / "k").exists()
