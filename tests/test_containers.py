"""The container images' recipe as `make` drives it (the builds themselves run in CI:
containers/build_ci.sh, whose test stage serves a completion from inside the image): tags follow
the package's version, a host without a builder is told why, and the build context carries
every file the Containerfile copies."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import distserve

ROOT = Path(__file__).resolve().parent.parent


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_images_are_tagged_with_the_package_version():
    # -n: the commands, not run; CONTAINER and VENV given so that nothing is looked up or made.
    for target, image in (("image", "distserve-mesh"), ("image-cuda", "distserve-mesh-cuda")):
        done = _make("-n", target, "CONTAINER=podman", "VENV=/nonexistent", "BIN=/usr/bin")
        assert done.returncode == 0, done.stderr
        assert f"-t {image}:{distserve.__version__} " in done.stdout, done.stdout


def test_make_image_without_podman_or_docker_fails_saying_so():
    for target in ("image", "image-cuda"):
        done = _make(target, "CONTAINER=", "BIN=/usr/bin")
        assert done.returncode != 0
        assert "make image: needs podman or docker" in done.stderr, done.stderr


def _sent(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's rules (last match wins, `!` admits) send `path` to the build."""
    sent = True
    for rule in patterns:
        admit = rule.startswith("!")
        rule = rule.lstrip("!")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(p, rule) or fnmatch.fnmatch(p, rule.replace("**/", ""))
            for p in prefixes
        ):
            sent = admit
    return sent


def test_the_build_context_carries_every_file_the_containerfile_copies():
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    recipe = (ROOT / "containers" / "Containerfile").read_text()
    sources = []
    for line in recipe.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += line.split()[1:-1]
    sources += re.findall(r"--mount=type=bind,source=([^,\s]+)", recipe)
    assert "pyproject.toml" in sources and "containers/smoke_test.py" in sources
    for source in sources:
        assert _sent(source, rules), f"{source} is copied by the Containerfile, not sent"
    for kept_out in (".venv/bin/python", "services/common/gen/x_pb2.py", ".git/HEAD"):
        assert not _sent(kept_out, rules), kept_out
