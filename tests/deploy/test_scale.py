"""`distserve deploy scale` (distserve/deploy/scale.py): a new placement becomes merge patches
of the rendered worker Deployments that change only their replicas, validate against the
upstream schema, and come with the exact kubectl commands."""

from __future__ import annotations

import copy
import json
import shlex

import kubernetes_validate
import pytest

from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from distserve.deploy.scale import DELETION_COST, ReplicaPatches
from services.common.errors import InvalidRequest
from tests.deploy.test_render import K8S_VERSIONS, find, load


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch, as `kubectl patch --type merge` applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def resized(plan: dict, prefill: int, decode: int) -> dict:
    """The plan with its placement's instance counts changed (same shapes)."""
    plan = copy.deepcopy(plan)
    placement = plan["placement"]
    by_role = {
        r: [i for i in placement["instances"] if i["role"] == r] for r in ("prefill", "decode")
    }
    placement["instances"] = [by_role["prefill"][0]] * prefill + [by_role["decode"][0]] * decode
    placement["phases"]["prefill"]["replicas"] = prefill
    placement["phases"]["decode"]["replicas"] = decode
    return plan


def patched(manifests, command: str) -> tuple[str, dict]:
    """The Deployment a `kubectl patch` command names, with its patch file applied."""
    words = shlex.split(command)
    assert words[:4] == ["kubectl", "-n", "distserve", "patch"] and words[4] == "deployment"
    name = words[5]
    assert words[6:9] == ["--type", "merge", "--patch-file"]
    with open(words[9]) as f:
        patch = json.load(f)
    return name, merge_patch(find(manifests, "Deployment", name), patch)


def test_a_new_placement_patches_only_the_replicas_and_validates(tmp_path):
    plan = load("plan_high_affinity.json")  # prefill tp=4 x2, decode tp=4 x2
    manifests = render(plan)
    patches = ReplicaPatches(plan, tmp_path)
    commands = patches.apply(resized(plan, prefill=3, decode=1))
    # Down first (the GPUs it frees are the ones the new pod needs), then up.
    assert [shlex.split(c)[5] for c in commands] == ["distserve-decode", "distserve-prefill"]
    for command, replicas in zip(commands, (1, 3), strict=True):
        name, deployment = patched(manifests, command)
        before = find(manifests, "Deployment", name)
        assert deployment["spec"]["replicas"] == replicas
        deployment["spec"]["replicas"] = before["spec"]["replicas"]
        assert deployment == before  # nothing but the replicas changed
        deployment["spec"]["replicas"] = replicas
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(deployment, version, strict=True)
    assert patches.counts() == {"prefill": 3, "decode": 1}
    assert patches.apply(resized(plan, prefill=3, decode=1)) == []  # already so: nothing


def test_draining_a_pod_marks_it_to_go_first_and_scales_its_pool_down(tmp_path):
    plan = load("plan_low_affinity.json")
    manifests = render(plan)
    patches = ReplicaPatches(plan, tmp_path)
    (pool,) = [n for n in patches.pools if n.startswith("distserve-decode")][:1]
    replicas = patches.pools[pool].replicas
    patches.drain(f"{pool}-6d4cf56db6-x2x7q")
    annotate, patch = patches.commands
    assert shlex.split(annotate) == [
        "kubectl",
        "-n",
        "distserve",
        "annotate",
        "pod",
        f"{pool}-6d4cf56db6-x2x7q",
        f"{DELETION_COST}=-1000",
        "--overwrite",
    ]
    name, deployment = patched(manifests, patch)
    assert (name, deployment["spec"]["replicas"]) == (pool, replicas - 1)


def test_what_a_replica_patch_cannot_do_is_refused(tmp_path):
    plan = load("plan_high_affinity.json")
    patches = ReplicaPatches(plan, tmp_path, RenderOptions(namespace="llm"))
    other = copy.deepcopy(plan)
    for inst in other["placement"]["instances"]:  # tp 4 -> 2
        inst["tp"] = 2
        inst["stages"][0]["gpus"] = inst["stages"][0]["gpus"][:2]
    with pytest.raises(InvalidRequest, match="distserve deploy render"):
        patches.apply(other)
    with pytest.raises(InvalidRequest, match="no pool 'distserve-encode'"):
        patches.scale("distserve-encode", "prefill", 1)
    with pytest.raises(InvalidRequest, match="runs prefill instances, not decode"):
        patches.scale("distserve-prefill", "decode", 1)
    with pytest.raises(InvalidRequest, match="belongs to none"):
        patches.drain("gateway-0")
    assert patches.commands == []


def test_deploy_scale_prints_the_commands_and_writes_the_patches(tmp_path, capsys):
    from distserve.cli import main

    plan = load("plan_high_affinity.json")
    (tmp_path / "now.json").write_text(json.dumps(plan))
    (tmp_path / "next.json").write_text(json.dumps(resized(plan, prefill=2, decode=3)))
    args = ["deploy", "scale", "--placement", str(tmp_path / "now.json")]
    args += ["--to", str(tmp_path / "next.json"), "--out", str(tmp_path / "patches")]
    assert main(args) == 0
    (command,) = capsys.readouterr().out.splitlines()
    name, deployment = patched(render(plan), command)
    assert (name, deployment["spec"]["replicas"]) == ("distserve-decode", 3)
