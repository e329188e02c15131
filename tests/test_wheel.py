"""The installable package: the wheel and the sdist built as a user builds them (`python -m build`),
the wheel installed into a fresh venv, and `distserve up --no-edge` run from it away from the
checkout, serving a completion.

The builds run on a clean copy of the sources (what a fresh clone holds, without the git-ignored
stubs), so that they never write build/ or *.egg-info into a checkout others are using, and so that
the stubs in the wheel can only have come from the build hook (setup.py). They run without build
isolation: CI reaches no network beyond the package index, and an isolated build would fetch
setuptools and grpcio-tools each time; `build` still refuses to run when [build-system].requires
is not satisfied by this venv.

The fresh venv is made without pip and reaches the project's dependencies through a .pth file
naming this venv's site-packages, and the wheel is installed into it with --no-deps: installing
torch and the rest anew would take minutes. A .pth entry is appended after the venv's own
site-packages, and the .pth files inside the named folder are not run, so this venv's editable
install of the checkout stays inert there, and the installed wheel's files win. A sitecustomize.py
in the fresh venv records, at each process's exit, where every module it imported came from: the
test asserts that none came from the checkout.

Slow: 45-90 s of wall time on two shared cores (about 35 s of CPU): three builds, then a mesh
started from the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import grpc
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# What a fresh clone holds that the build reads; everything else (tests, bench, docs) is not built.
SOURCES = (
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
    "README.md",
    "protos",
    "services",
    "distserve",
)
GEN = "services/common/gen/distserve/v1"
PROTO_NAMES = sorted(p.stem for p in (ROOT / "protos" / "distserve" / "v1").glob("*.proto"))

# Written into the fresh venv: each process, at exit, lists its modules and their files.
SITECUSTOMIZE = """\
import atexit, json, os, sys

def _record():
    out = os.path.join(os.environ["DISTSERVE_TEST_MODULES"], f"{os.getpid()}.json")
    files = {name: getattr(m, "__file__", None) for name, m in list(sys.modules.items())}
    with open(out, "w") as f:
        json.dump({"argv": sys.argv, "path": sys.path, "modules": files}, f)

if os.environ.get("DISTSERVE_TEST_MODULES"):
    atexit.register(_record)
"""


def _clean_copy(dest: Path) -> Path:
    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
        return skip | ({"gen"} if Path(folder) == ROOT / "services" / "common" else set())

    dest.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def _build(source: Path, out: Path, *flags: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--no-isolation",
            "--outdir",
            str(out),
            *flags,
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """{"wheel": built from the source tree, "sdist": the sdist, "wheel_from_sdist": the wheel
    `python -m build` makes by unpacking that sdist and building it}."""
    tmp = tmp_path_factory.mktemp("dists")
    source = _clean_copy(tmp / "src")
    _build(source, tmp / "direct", "--wheel")
    _build(source, tmp / "via-sdist")  # an sdist, then a wheel built from it
    (wheel,) = (tmp / "direct").glob("*.whl")
    (sdist,) = (tmp / "via-sdist").glob("*.tar.gz")
    (from_sdist,) = (tmp / "via-sdist").glob("*.whl")
    return {"wheel": wheel, "sdist": sdist, "wheel_from_sdist": from_sdist}


def _wheel_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as z:
        return {n: z.read(n) for n in z.namelist() if ".dist-info/" not in n}


def _runtime_files() -> set[str]:
    """Every file of the checkout's packages a running mesh may import or read: modules and
    package data (the embedded corpus, the latency profiles...), bytecode caches and stubs aside."""
    found = set()
    for top in ("services", "distserve"):
        for path in (ROOT / top).rglob("*"):
            rel = path.relative_to(ROOT).as_posix()
            if (
                path.is_file()
                and "__pycache__" not in rel
                and not rel.startswith("services/common/gen/")
            ):
                found.add(rel)
    return found


def _stubs() -> set[str]:
    kinds = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", ".proto")
    return {f"{GEN}/{name}{kind}" for name in PROTO_NAMES for kind in kinds}


def test_the_wheel_carries_every_module_data_file_stub_and_proto(dists):
    files = set(_wheel_files(dists["wheel"]))
    assert "services/engine/data/corpus.txt" in files  # the embedded models' tokenizer corpus
    assert not _runtime_files() - files, "files of the checkout missing from the wheel"
    assert not _stubs() - files, "generated stubs or protos missing from the wheel"


def test_the_sdist_carries_the_protos_the_hook_and_the_stubs(dists):
    with tarfile.open(dists["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {f"protos/distserve/v1/{name}.proto" for name in PROTO_NAMES} <= names
    assert {"setup.py", "MANIFEST.in", "services/common/build_protos.py"} <= names
    assert _stubs() <= names


def test_a_wheel_built_from_the_sdist_equals_the_wheel_built_from_the_tree(dists):
    assert _wheel_files(dists["wheel_from_sdist"]) == _wheel_files(dists["wheel"])


def test_the_declared_grpc_and_protobuf_floors_cover_the_built_stubs(dists):
    """Generated stubs refuse a runtime older than the grpcio-tools that wrote them: the wheel's
    requirements must not admit one."""
    with zipfile.ZipFile(dists["wheel"]) as z:
        (meta,) = (n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = z.read(meta).decode()
        grpc_stub = z.read(f"{GEN}/common_pb2_grpc.py").decode()
        pb2 = z.read(f"{GEN}/common_pb2.py").decode()
    runtime = [
        Requirement(line.split(":", 1)[1].strip())
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    requires = {r.name: r for r in runtime}
    built = {
        "grpcio": re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_stub)[1],
        "protobuf": re.search(r"# Protobuf Python Version: (\S+)", pb2)[1],
    }
    for name, version in built.items():
        floors = [
            Version(s.version) for s in requires[name].specifier if s.operator in (">=", "==")
        ]
        assert floors and min(floors) >= Version(version), (name, requires[name], version)


def test_the_installed_wheel_serves_a_completion_away_from_the_checkout(dists, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "project-dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    pip += ["--no-deps", "--no-index", "--ignore-installed", str(dists["wheel_from_sdist"])]
    subprocess.run(pip, check=True, timeout=120)

    records = tmp_path / "modules"
    records.mkdir()
    run_dir = tmp_path / "run"  # outside the checkout: the checkout is not on sys.path
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "DISTSERVE_CACHE": str(tmp_path / "cache"),  # the tiny model, made from the wheel's data
        "DISTSERVE_TEST_MODULES": str(records),
    }
    distserve = str(venv / "bin" / "distserve")
    version = subprocess.run(
        [distserve, "--version"], capture_output=True, text=True, env=env, cwd=run_dir
    )
    assert version.stdout.strip() == f"distserve {declared_version()}"

    proc = subprocess.Popen(
        [distserve, "up", "--no-edge", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=run_dir,
        env=env,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        assert lines and "serving" in lines[-1], "".join(lines)
        gateway = next(ln.split()[-1] for ln in lines if "gateway (gRPC) on" in ln)
        with grpc.insecure_channel(gateway) as channel:
            params = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
            request = gateway_pb2.GenerateRequest(text="Hello mesh", sampling=params)
            stream = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60)
            ids = [i for r in stream for i in r.token_ids]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

    # The same tokens as the checkout's engine on the model the installed package made.
    (model,) = (tmp_path / "cache" / "models").iterdir()
    engine = LLMEngine(model, EngineConfig(num_blocks=32))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert ids == engine.generate(["Hello mesh"], greedy)[0].token_ids

    seen = [json.loads(p.read_text()) for p in records.iterdir()]
    entry_points = {r["argv"][0] for r in seen}
    for role in ("gateway", "prefill", "decode"):
        assert any(f"services/{role}/" in e for e in entry_points), (role, entry_points)
    for record in seen:
        assert str(ROOT) not in record["path"], record["argv"]
        for name, file in record["modules"].items():
            # The checkout's files: none (the dependencies' folders may lie inside it, as a
            # venv made in the checkout does: those are not the checkout's code).
            ours = (file or "").startswith(f"{ROOT}/")
            dependency = any((file or "").startswith(f"{d}/") for d in deps)
            assert not ours or dependency, (name, file, record["argv"])
            if name.split(".")[0] in ("services", "distserve") and file:
                assert file.startswith(f"{site}/"), (name, file)


def declared_version() -> str:
    """distserve.__version__ as the checkout declares it (read, not imported: the one place)."""
    text = (ROOT / "distserve" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)
