"""`--model` as a Hugging Face Hub id, resolved offline from a cache laid out as huggingface_hub
lays it out (no network here: HF_HUB_OFFLINE=1 and the cache a test fills)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from services.common.errors import InvalidRequest, ModelLoadError
from services.common.hub import is_hub_id, resolve_model

REPO = "distserve-test/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_hf_cache(hf_home: Path, repo: str, folder: Path, commit: str = COMMIT) -> Path:
    """Put `folder`'s files into the cache under HF_HOME as huggingface_hub stores a download:
    hub/models--{org}--{name}/blobs/<sha256> holding the bytes, snapshots/<commit>/<file> a
    relative symlink to its blob, refs/main naming the commit. Returns the snapshot folder."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def distserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.fixture
def hf_home(tmp_path, tiny_model) -> Path:
    home = tmp_path / "hf"
    fill_hf_cache(home, REPO, tiny_model)
    return home


def test_the_cache_the_tests_fill_is_the_layout_huggingface_hub_reads(hf_home):
    code = (
        "from huggingface_hub import scan_cache_dir, snapshot_download\n"
        f"repo = next(r for r in scan_cache_dir().repos if r.repo_id == {REPO!r})\n"
        "print(sorted(r.commit_hash for r in repo.revisions))\n"
        f"print(snapshot_download({REPO!r}, local_files_only=True))\n"
    )
    run = run_python(code, offline_env(hf_home))
    assert run.returncode == 0, run.stderr
    commits, snapshot = run.stdout.split("\n")[:2]
    assert commits == f"['{COMMIT}']"
    assert (
        Path(snapshot)
        == hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    )


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hf_home, tiny_model):
    code = f"from services.common.hub import resolve_model; print(resolve_model({REPO!r}))"
    run = run_python(code, offline_env(hf_home))
    assert run.returncode == 0, run.stderr
    folder = Path(run.stdout.strip())
    assert folder.name == COMMIT
    assert (folder / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()


def test_model_fetch_prints_the_folder_to_serve(hf_home):
    run = distserve("model", "fetch", REPO, env=offline_env(hf_home))
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).name == COMMIT


def test_an_unknown_id_offline_names_it_and_how_to_stage_it(hf_home):
    run = distserve("model", "fetch", "nobody/nothing", env=offline_env(hf_home))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    message = run.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "nobody/nothing" in message and "HF_HUB_OFFLINE is set" in message
    assert "distserve model fetch nobody/nothing" in message


def test_an_unreachable_hub_is_named_as_such(tmp_path):
    env = {**offline_env(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens
    del env["HF_HUB_OFFLINE"]
    code = "from services.common.hub import resolve_model; resolve_model('nobody/nothing')"
    run = run_python(code, env)
    assert "ModelLoadError" in run.stderr and "offline or unreachable (no connection)" in run.stderr


def test_a_local_folder_is_used_as_it_is(tiny_model):
    assert resolve_model(str(tiny_model)) == tiny_model
    with pytest.raises(InvalidRequest, match="--revision v1 is for a Hugging Face Hub id"):
        resolve_model(tiny_model, revision="v1")


def test_a_path_that_is_no_folder_and_no_hub_id_says_the_folder_is_missing(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "nothing" / "here")


@pytest.mark.parametrize(
    ("name", "hub"),
    [
        ("Qwen/Qwen2.5-0.5B", True),
        ("gpt2", True),
        ("./gpt2", False),
        ("/models/llama", False),
        ("a/b/c", False),
        ("~/m", False),
        ("bad name/x", False),
    ],
)
def test_hub_ids_are_told_from_paths(name, hub):
    assert is_hub_id(name) is hub


def test_the_workers_and_gateway_take_a_hub_id_and_resolve_it_themselves(hf_home, tmp_path):
    """Started on their own (a pod, not `distserve up`), each process resolves the id
    (tests/test_model_loading.py serves from an id end to end)."""
    resolve = {
        "services.gateway": "resolved(parse(argv))",
        "services.prefill": "with_local_model(*parse(argv)[:1], parse(argv)[1].revision)",
        "services.decode": "with_local_model(*parse(argv)[:1], parse(argv)[1].revision)",
    }
    for service, how in resolve.items():
        code = (
            f"from {service}.__main__ import *\nargv = ['--model', {REPO!r}]\nprint({how}.model)\n"
        )
        run = run_python(code, offline_env(hf_home))
        assert run.returncode == 0, run.stderr
        assert Path(run.stdout.strip()).name == COMMIT


def test_only_the_files_the_mesh_reads_are_fetched():
    """MODEL_FILES through huggingface_hub's own filter (what snapshot_download applies to a
    repository's file list), on the files of a typical Hub repository."""
    from huggingface_hub.utils import filter_repo_objects

    from services.common.hub import MODEL_FILES

    repo = [
        ".gitattributes",
        "README.md",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "consolidated.safetensors",
        "original/consolidated.00.pth",
        "original/model.safetensors",
        "pytorch_model.bin",
        "tf_model.h5",
        "onnx/model.onnx",
        "model.gguf",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ]
    fetched = set(filter_repo_objects(repo, allow_patterns=list(MODEL_FILES)))
    assert fetched == {
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }


def test_tokenizer_only_fetches_what_the_gateway_reads_and_no_weights():
    from huggingface_hub.utils import filter_repo_objects

    from services.common.hub import TOKENIZER_FILES

    repo = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "model.safetensors",
        "pytorch_model.bin",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "README.md",
    ]
    fetched = set(filter_repo_objects(repo, allow_patterns=list(TOKENIZER_FILES)))
    assert fetched == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def tokenizer_cache(tmp_path, tiny_model) -> Path:
    """HF_HOME with the tokenizer-only files of the repository (what `model fetch
    --tokenizer-only` leaves in a cache), and the listing of all its files, weights included,
    as huggingface_hub caches it when it lists a repository (trees/<commit>.json)."""
    from services.common.hub import TOKENIZER_FILES

    home, part = tmp_path / "hf", tmp_path / "tokenizer-only"
    part.mkdir()
    for file in tiny_model.iterdir():
        if file.name in TOKENIZER_FILES:
            (part / file.name).write_bytes(file.read_bytes())
    assert not (part / "model.safetensors").exists()
    snapshot = fill_hf_cache(home, REPO, part)
    files = {
        f.name: {"size": f.stat().st_size, "blob_id": _git_blob_id(f.read_bytes())}
        for f in sorted(tiny_model.iterdir())
    }
    trees = snapshot.parent.parent / "trees"
    trees.mkdir()
    (trees / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    return home


def test_a_tokenizer_only_fetch_is_what_the_gateway_serves_from(tokenizer_cache, tiny_model):
    env = offline_env(tokenizer_cache)
    run = distserve("model", "fetch", REPO, "--tokenizer-only", env=env)
    assert run.returncode == 0, run.stderr
    folder = Path(run.stdout.strip())
    assert folder.name == COMMIT and not (folder / "model.safetensors").exists()
    # The whole model's files are not there: a full fetch (a worker's) is refused, by name.
    full = distserve("model", "fetch", REPO, env=env)
    assert full.returncode == 2 and "Traceback" not in full.stderr
    assert len(full.stderr.strip().splitlines()) == 1
    assert "holds only part of distserve-test/tiny-chat" in full.stderr
    assert "model.safetensors" in full.stderr
    # The gateway starts from the tokenizer-only folder and serves its API.
    gateway = subprocess.Popen(
        [
            sys.executable, "-m", "services.gateway", "--model", str(folder), "--port", "0",
            "--http-port", "0", "--metrics-port", "-1", "--served-model-name", "tiny",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        ready = json.loads(gateway.stdout.readline())
        assert ready["event"] == "ready", ready
        with urllib.request.urlopen(f"http://{ready['http_address']}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny"]
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
