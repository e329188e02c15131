"""docs/kubernetes.md as a platform engineer copies it: every ```sh block runs here as written,
in order, in one folder (the plan, the Secrets' files, the render, `kubectl kustomize` and the
client dry-run, the latter against tests/deploy/api_server.py standing in for the cluster's API
server); every ```sh cluster block needs a cluster, a registry or a container builder and is not
run, but each `distserve` command in it must parse with the CLI's own parser and each `make`
target must exist. Image tags in the page are this package's version."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

import distserve
from distserve.cli import REGISTRARS
from tests.deploy.api_server import ApiServer
from tests.deploy.test_render import HERE, ROOT

PAGE = ROOT / "docs/kubernetes.md"
BLOCK = re.compile(r"^```(\w*)[ \t]*(\S*)\n(.*?)^```$", re.M | re.S)
TAGS = {"": "runs here", "cluster": "needs a cluster, a registry or a container builder"}


def blocks(tag: str) -> list[str]:
    """The bodies of the page's ```sh blocks tagged `tag` ("": runs here), in page order."""
    found = [(t, body) for lang, t, body in BLOCK.findall(PAGE.read_text()) if lang == "sh"]
    unknown = {t for t, _ in found} - TAGS.keys()
    assert not unknown, f"```sh blocks tagged {unknown}: tag them as one of {set(TAGS)}"
    return [body for t, body in found if t == tag]


def commands(block: str) -> list[list[str]]:
    """The block's command lines (continuations joined, comments dropped) as words."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [words for words in lines if words]


def test_the_pages_runnable_blocks_run_here_as_written(tmp_path):
    runnable = blocks("")
    assert any("distserve plan" in b for b in runnable)
    assert any("distserve deploy render" in b for b in runnable)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "distserve"  # this checkout's CLI, as the installed script would run it
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m distserve.cli "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp_path),
        "HF_TOKEN": "hf_placeholder",  # what the reader exports for a gated model
    }
    crd = yaml.safe_load((HERE / "crds/monitoring.coreos.com_servicemonitors.yaml").read_text())
    api = ApiServer([crd])
    not_run = []
    try:
        env["KUBECONFIG"] = str(api.kubeconfig(tmp_path / "kubeconfig"))
        for block in runnable:
            if "kubectl" in block and shutil.which("kubectl") is None:
                not_run.append(block)
                continue
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block],
                cwd=work, env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    finally:
        api.close()
    (kustomization,) = yaml.safe_load_all((work / "k8s/kustomization.yaml").read_text())
    assert {"secrets.yaml", "planner-rbac.yaml", "monitoring.yaml"} <= set(
        kustomization["resources"]
    )
    if not_run:
        pytest.skip("kubectl is not installed here; not run:\n" + "\n".join(not_run))


def parser() -> argparse.ArgumentParser:
    """`distserve`'s parser, as distserve.command.run builds it."""
    p = argparse.ArgumentParser(prog="distserve")
    sub = p.add_subparsers(dest="command", required=True)
    for register in REGISTRARS:
        register(sub)
    return p


def test_every_distserve_command_on_the_page_parses_and_every_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    cli = parser()
    seen = 0
    for block in blocks("") + blocks("cluster"):
        for words in commands(block):
            if words[0] == "distserve":
                cli.parse_args(words[1:])  # an unknown flag exits: SystemExit fails the test
                seen += 1
            if words[0] == "make":
                assert set(w for w in words[1:] if "=" not in w) <= targets, words
    assert seen >= 6


def test_the_pages_image_tags_are_this_packages_version():
    tags = re.findall(r"distserve-mesh(?:-cuda)?:([\w.<>-]+)", PAGE.read_text())
    assert tags
    assert set(tags) <= {distserve.__version__, "<version>", "VERSION"}, tags


def test_a_misspelt_flag_on_the_page_would_fail():
    with pytest.raises(SystemExit):
        parser().parse_args(
            ["deploy", "render", "--placement", "p", "--out", "o", "--tls-crt", "x"]
        )
