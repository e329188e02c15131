"""Monitoring (distserve/deploy/monitoring.py) and model staging (model_volume.py): the
ServiceMonitor validated strictly against the Prometheus operator's own CRD schema (vendored in
crds/), the scrape annotations on every pod serving /metrics, and the Hub model's init container."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml

from distserve.cli import main as distserve_main
from distserve.deploy.model_volume import ModelSource
from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from services.common.errors import InvalidRequest
from tests.deploy.test_render import (
    HERE,
    K8S_VERSIONS,
    WORKLOADS,
    container,
    deployments,
    load,
    objects,
    workloads,
)

CRD = HERE / "crds" / "monitoring.coreos.com_servicemonitors.yaml"


def strict(schema: dict) -> dict:
    """The CRD's schema as the API server prunes it: an object with listed properties takes no
    other field (kubectl's strict field validation refuses unknown fields)."""
    schema = copy.deepcopy(schema)

    def walk(s: object) -> None:
        if isinstance(s, dict):
            if "properties" in s and not s.get("x-kubernetes-preserve-unknown-fields"):
                s.setdefault("additionalProperties", False)
            for v in s.values():
                walk(v)
        elif isinstance(s, list):
            for v in s:
                walk(v)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    (crd,) = [d for d in yaml.safe_load_all(CRD.read_text()) if d]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def monitored() -> dict[str, list[dict]]:
    return render(load("plan_low_affinity.json"), RenderOptions(service_monitor=True))


def test_the_service_monitor_is_valid_against_the_operators_crd(monitored, validator):
    (monitor,) = monitored["monitoring.yaml"]
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    validator.validate(monitor)
    wrong = copy.deepcopy(monitor)
    wrong["spec"]["endpoints"][0]["intervall"] = "15s"  # a misspelt field is caught
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(wrong)
    assert "monitoring.yaml" in monitored["kustomization.yaml"][0]["resources"]
    assert "monitoring.yaml" not in render(load("plan_low_affinity.json"))


def test_the_service_monitor_selects_exactly_the_services_that_serve_metrics(monitored):
    (monitor,) = monitored["monitoring.yaml"]
    selector = monitor["spec"]["selector"]
    (port,) = {e["port"] for e in monitor["spec"]["endpoints"]}
    chosen_components = set()
    for service in (o for o in objects(monitored) if o["kind"] == "Service"):
        labels = service["metadata"]["labels"]
        chosen = selector["matchLabels"].items() <= labels.items() and all(
            labels[e["key"]] in e["values"] for e in selector.get("matchExpressions", [])
        )
        has_port = port in {p["name"] for p in service["spec"]["ports"]}
        assert chosen == has_port, service["metadata"]["name"]
        if chosen:
            chosen_components.add(labels["app.kubernetes.io/component"])
    assert chosen_components == {"gateway", "planner", "envoy", "prefill", "decode"}
    # Envoy's statistics have a Service of their own: the public edge Service carries only
    # the edge's port (a LoadBalancer never exposes them).
    (public,) = [
        o
        for o in objects(monitored)
        if (o["kind"], o["metadata"]["name"]) == ("Service", "distserve-envoy")
    ]
    assert [p["name"] for p in public["spec"]["ports"]] == ["http"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["distserve"]}


def test_pods_serving_metrics_carry_the_prometheus_annotations_of_their_metrics_port(monitored):
    for d in (o for o in objects(monitored) if o["kind"] in WORKLOADS):
        template = d["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        ports = {p["name"]: p["containerPort"] for p in container(d).get("ports", [])}
        if "metrics" in ports:
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/port"] == str(ports["metrics"])
            assert annotations["prometheus.io/path"] == "/metrics"
        else:
            assert "prometheus.io/scrape" not in annotations, d["metadata"]["name"]


def test_a_hub_model_is_staged_by_an_init_container_into_each_pods_volume():
    options = RenderOptions(model=ModelSource(hub_id="Qwen/Qwen2.5-0.5B", revision="v1"))
    m = render(load("plan_high_affinity.json"), options)
    for component in ("gateway", "prefill", "decode"):
        spec = deployments(m, component)[0]["spec"]["template"]["spec"]
        (step,) = spec["initContainers"]
        # The gateway reads no weights: it stages the tokenizer and configs alone.
        gateway = component == "gateway"
        assert step["command"] + step["args"] == [
            "python", "-m", "distserve.cli", "model", "fetch", "Qwen/Qwen2.5-0.5B",
            "--to", "/models/model", "--revision", "v1", *["--tokenizer-only"] * gateway,
        ]  # fmt: skip
        assert {"name": "model", "mountPath": "/models"} in step["volumeMounts"]  # writable
        mounts = {v["name"]: v for v in spec["containers"][0]["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        # opt-66b: 123 GiB of fp16, +10%; the gateway's tokenizer and configs: the least, 1 GiB
        assert volume["emptyDir"] == {"sizeLimit": "1Gi" if gateway else "136Gi"}
    for component in ("planner", "envoy"):
        spec = workloads(m, component)[0]["spec"]["template"]["spec"]
        assert all(c["name"] != "stage-model" for c in spec.get("initContainers", []))
    for obj in objects(m):
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
    pvc = render(
        load("plan_high_affinity.json"),
        RenderOptions(model=ModelSource(hub_id="Qwen/Qwen2.5-0.5B", pvc="shared-models")),
    )
    spec = deployments(pvc, "decode")[0]["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "shared-models"}  # writable


def test_the_staging_command_is_one_the_distserve_cli_takes(capsys):
    m = render(load("plan_high_affinity.json"), RenderOptions(model=ModelSource(hub_id="a/b")))
    (step,) = deployments(m, "decode")[0]["spec"]["template"]["spec"]["initContainers"]
    with pytest.raises(SystemExit) as done:
        distserve_main([*step["args"][:3], "--help"])  # the subcommand and its options exist
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert "--to DIR" in usage and "--revision" in usage and "--tokenizer-only" in usage


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"hub_id": "a/b", "host_path": "/mnt"}, "give one of them"),
        ({"revision": "main"}, "--revision goes with --model"),
        ({"hub_id": "../etc"}, "is not a Hub id"),
        ({"pvc": "x", "host_path": "/mnt"}, "not both"),
    ],
)
def test_a_model_source_that_cannot_work_is_refused(source, message):
    with pytest.raises(InvalidRequest, match=message):
        ModelSource(**source)
