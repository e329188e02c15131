"""Models loaded the way users load them: `distserve up --model ORG/NAME` served from the Hugging
Face cache offline, the model's generation_config.json defaults, and folders refused at start
(each process exits with one line naming the reason; the rest of the mesh goes on)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import requests

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.common.test_hub import fill_hf_cache, offline_env

REPO = "distserve-test/greedy-tiny"
START_TIMEOUT_S = 180


def copy_model(tiny_model: Path, folder: Path, **generation: object) -> Path:
    shutil.copytree(tiny_model, folder)
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **generation}))
    return folder


@pytest.fixture(scope="module")
def hub_mesh(tiny_model, tmp_path_factory):
    """`distserve up --model REPO` (1P1D, no Envoy), REPO only in a local HF cache, offline;
    the model's generation_config.json: temperature 0, max_new_tokens 5."""
    tmp = tmp_path_factory.mktemp("hub")
    model = copy_model(tiny_model, tmp / "model", temperature=0.0, max_new_tokens=5)
    hf_home = tmp / "hf"
    snapshot = fill_hf_cache(hf_home, REPO, model)
    argv = ["up", "--model", REPO, "--port", "0", "--no-edge", "--gateway-http-port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserve.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=offline_env(hf_home),
        cwd=tmp,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        assert any("serving" in ln for ln in lines), "".join(lines)
        grpc_address = next(ln.split()[-1] for ln in lines if "gateway (gRPC) on" in ln)
        http_address = next(ln.split()[-1] for ln in lines if "gateway (HTTP) on" in ln)
        etcd = next(ln.split()[3] for ln in lines if "distserve: etcd on" in ln)
        yield {
            "etcd": etcd,
            "proc": proc,
            "grpc": grpc_address,
            "http": f"http://{http_address}",
            "snapshot": snapshot,
            "hf_home": hf_home,
        }
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def complete(mesh, **body) -> dict:
    body = {"prompt": "Hello mesh", "ignore_eos": True, **body}
    r = requests.post(f"{mesh['http']}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def workers(mesh) -> set[str]:
    with grpc.insecure_channel(mesh["grpc"]) as channel:
        stub = gateway_pb2_grpc.WorkerRegistryStub(channel)
        return {w.worker_id for w in stub.ListWorkers(gateway_pb2.ListWorkersRequest()).workers}


def children_models(pid: int) -> list[str]:
    """The --model argument of each child process of `pid` that has one (etcd has none)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    argvs = [Path(f"/proc/{int(c)}/cmdline").read_text().split("\0") for c in out.stdout.split()]
    return [argv[argv.index("--model") + 1] for argv in argvs if "--model" in argv]


def test_up_serves_a_hub_id_from_the_offline_cache_under_its_id(hub_mesh):
    models = requests.get(f"{hub_mesh['http']}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [REPO]
    # Resolved once by `up`: every process was handed the snapshot folder, not the id.
    assert children_models(hub_mesh["proc"].pid) == [str(hub_mesh["snapshot"])] * 3
    chat = requests.post(
        f"{hub_mesh['http']}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text


def test_generation_config_temperature_0_makes_an_unset_temperature_greedy(hub_mesh):
    first = complete(hub_mesh, max_tokens=12, seed=1)["choices"][0]["text"]
    second = complete(hub_mesh, max_tokens=12, seed=2)["choices"][0]["text"]
    greedy = complete(hub_mesh, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert first == second == greedy
    # A request's own temperature wins over the model's default.
    sampled = {
        complete(hub_mesh, max_tokens=12, temperature=1.0, seed=s)["choices"][0]["text"]
        for s in (1, 2, 3)
    }
    assert len(sampled) > 1


def test_generation_config_max_new_tokens_is_the_default_length(hub_mesh):
    assert complete(hub_mesh)["usage"]["completion_tokens"] == 5  # not /v1/completions' 16
    assert complete(hub_mesh, max_tokens=7)["usage"]["completion_tokens"] == 7


def test_grpc_requests_take_the_generation_defaults_too(hub_mesh):
    async_free = common_pb2.SamplingParams(ignore_eos=True, seed=1)
    with grpc.insecure_channel(hub_mesh["grpc"]) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def ids(params) -> list[int]:
            req = gateway_pb2.GenerateRequest(text="Hello mesh", sampling=params)
            return [t for r in stub.Generate(req) for t in r.token_ids]

        default = ids(async_free)
        assert len(default) == 5  # max_new_tokens
        assert default == ids(common_pb2.SamplingParams(ignore_eos=True, seed=2, max_tokens=5))
        hot = common_pb2.SamplingParams(ignore_eos=True, max_tokens=12, temperature=1.0)
        assert len({tuple(ids(hot)) for _ in range(3)}) > 1


def start_refused(service: str, folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [sys.executable, "-m", service, "--model", str(folder), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=START_TIMEOUT_S,
    )


def assert_one_line_refusal(run: subprocess.CompletedProcess, service: str, *words: str) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith(f"{service}: error:")]
    assert len(errors) == 1, run.stderr
    for word in words:
        assert word in errors[0], errors[0]


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("q") / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tokenizerless(tiny_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("t") / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "tokenizer.json").unlink()
    return folder


def test_a_worker_on_a_quantized_checkpoint_is_refused_and_the_mesh_goes_on(hub_mesh, quantized):
    before = workers(hub_mesh)
    run = start_refused(
        "services.prefill", quantized, "--etcd", hub_mesh["etcd"], "--no-ucx", "--worker-id", "q"
    )
    assert_one_line_refusal(
        run, "prefill", "quantization_config", "'gptq'", "float32, bfloat16 or float16"
    )
    assert workers(hub_mesh) == before
    assert complete(hub_mesh, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_a_worker_without_a_tokenizer_is_refused_and_the_mesh_goes_on(hub_mesh, tokenizerless):
    before = workers(hub_mesh)
    run = start_refused("services.decode", tokenizerless, "--etcd", hub_mesh["etcd"])
    assert_one_line_refusal(run, "decode", "has no tokenizer.json", str(tokenizerless))
    assert workers(hub_mesh) == before
    assert complete(hub_mesh, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_a_gateway_is_refused_on_the_same_folders(quantized, tokenizerless):
    run = start_refused("services.gateway", quantized, "--port", "0", "--http-port", "-1")
    assert_one_line_refusal(run, "gateway", "quantization_config")
    run = start_refused("services.gateway", tokenizerless, "--port", "0", "--http-port", "-1")
    assert_one_line_refusal(run, "gateway", "has no tokenizer.json")


def test_an_unknown_hub_id_offline_stops_up_with_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "up", "--model", "nobody/nothing", "--no-edge"],
        capture_output=True,
        text=True,
        env=offline_env(tmp_path / "hf"),
        timeout=START_TIMEOUT_S,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "nobody/nothing" in run.stderr and "distserve model fetch" in run.stderr
    assert "offline" in run.stderr


def test_a_model_without_a_chat_template_refuses_chat_with_a_400(tiny_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["--model", str(folder), "--port", "0", "--http-port", "0", "--metrics-port", "-1"]
    gateway = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready = json.loads(next(ln for ln in gateway.stdout if ln.startswith("{")))
        r = requests.post(
            f"http://{ready['http_address']}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "has no chat template" in error["message"] and error["param"] == "messages"
        assert "/v1/completions" in error["message"] and "--chat-template" in error["message"]
    finally:
        gateway.kill()
        gateway.wait()


def test_generation_defaults_are_read_and_checked(tiny_model, tmp_path):
    from services.common.errors import ModelLoadError
    from services.common.generation_defaults import GenerationDefaults

    assert GenerationDefaults.from_dir(tiny_model) == GenerationDefaults()  # EOS ids only
    folder = copy_model(
        tiny_model, tmp_path / "m", temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.3
    )
    assert GenerationDefaults.from_dir(folder) == GenerationDefaults(0.6, 0.9, 20, None, 1.3)
    for bad, words in (
        ({"top_p": 0}, "top_p"),
        ({"top_k": "many"}, "top_k must be an integer"),
        ({"min_p": 2}, "min_p must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ):
        folder = copy_model(tiny_model, tmp_path / f"bad{len(words)}", **bad)
        with pytest.raises(ModelLoadError, match=words):
            GenerationDefaults.from_dir(folder)


def test_a_requests_own_sampling_values_win_over_the_models_defaults():
    from services.common.convert import sampling_from_pb
    from services.common.gen.distserve.v1 import common_pb2
    from services.common.generation_defaults import GenerationDefaults
    from services.gateway.openai_protocol import COMPLETIONS, parse

    defaults = GenerationDefaults(
        temperature=0.0, top_p=0.5, top_k=7, max_tokens=5, repetition_penalty=1.3, min_p=0.05
    )
    implicit = parse(COMPLETIONS, {"prompt": "x"}, None, defaults)
    p = implicit.params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (
        0,
        0.5,
        7,
        1.3,
        0.05,
    )
    grpc = sampling_from_pb(common_pb2.SamplingParams(max_tokens=3), defaults)
    assert (grpc.repetition_penalty, grpc.min_p) == (1.3, 0.05)
    grpc = sampling_from_pb(common_pb2.SamplingParams(max_tokens=3, min_p=0.0), defaults)
    assert grpc.min_p == 0.0  # set to 0: the request's own value
    assert implicit.fill_context  # up to max_new_tokens (Limits.default_max_tokens)
    body = {
        "prompt": "x",
        "temperature": 1.0,
        "top_p": 1,
        "top_k": -1,
        "max_tokens": 9,
        "repetition_penalty": 1.0,
        "min_p": 0,
    }
    explicit = parse(COMPLETIONS, body, None, defaults)
    assert (explicit.params.repetition_penalty, explicit.params.min_p) == (1.0, 0)
    assert (explicit.params.temperature, explicit.params.top_p, explicit.params.top_k) == (1, 1, 0)
    assert not explicit.fill_context and explicit.params.max_tokens == 9
