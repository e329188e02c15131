"""The `distserve` command line, run as a user would run it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine


def distserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_model_create_then_generate_json_matches_the_engine(tmp_path):
    out = tmp_path / "tiny"
    made = distserve("model", "create", "--preset", "tiny", "--out", str(out))
    assert made.returncode == 0, made.stderr
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / f).exists()
    run = distserve("generate", "--model", str(out), "--max-tokens", "12", "--json", "Hello mesh")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    engine = LLMEngine(out, EngineConfig(num_blocks=32))
    expected = engine.generate(["Hello mesh"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text
    assert result["usage"]["completion_tokens"] == len(expected.token_ids)


def test_generate_without_model_uses_the_embedded_default(tmp_path):
    env = {"DISTSERVE_CACHE": str(tmp_path)}
    run = distserve(
        "generate",
        "--max-tokens",
        "5",
        "--seed",
        "3",
        "--temperature",
        "1",
        "--json",
        "hi",
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) <= 5
    assert list((tmp_path / "models").glob("tiny-*/model.safetensors"))
    again = distserve(
        "generate",
        "--max-tokens",
        "5",
        "--seed",
        "3",
        "--temperature",
        "1",
        "--json",
        "hi",
        env=env,
    )
    assert json.loads(again.stdout)["token_ids"] == json.loads(run.stdout)["token_ids"]


def test_bad_input_is_a_clear_error_not_a_traceback(tiny_model):
    run = distserve("generate", "--model", str(tiny_model), "--top-p", "0", "x")
    assert run.returncode == 2
    assert "top_p must be in (0, 1]" in run.stderr and "Traceback" not in run.stderr
    run = distserve("generate", "--model", "/nonexistent/model", "x")
    assert run.returncode == 2 and "does not exist" in run.stderr


def test_a_tool_run_on_its_own_never_imports_the_cli_that_lists_it():
    """`distserve.command.run` serves `distserve` and every tool module alike: a tool run on its
    own (`python -m distserve.plan ...`) builds its parser without importing distserve.cli."""
    code = (
        "import sys, contextlib, io\n"
        "from distserve import plan\n"
        "from distserve.deploy import cli as deploy\n"
        "from distserve.loadgen import cli as loadgen\n"
        "for tool, argv in ((plan, ['plan', '--help']), (deploy, ['deploy', '--help']),\n"
        "                   (loadgen, ['bench', 'goodput', '--help'])):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        tool.main(argv)\n"
        "print('distserve.cli' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_run_turns_a_distserve_error_into_exit_status_2(capsys):
    from distserve.command import run
    from services.common.errors import InvalidRequest

    def register(sub) -> None:
        def fail(args) -> int:
            raise InvalidRequest("--budget must be >= 1")

        sub.add_parser("fail").set_defaults(func=fail)

    assert run((register,), ["fail"], "a tool") == 2
    assert "distserve: error: --budget must be >= 1" in capsys.readouterr().err


def _up_spec(monkeypatch, *argv: str):
    """The MeshSpec `distserve up ARGV` would start (nothing is started)."""
    import distserve.local_mesh
    from distserve.cli import main

    specs = []
    monkeypatch.setattr(distserve.local_mesh, "run_until_signal", lambda s: specs.append(s) or 0)
    assert main(["up", "--port", "0", *argv]) == 0
    return specs[0]


def test_up_passes_every_engine_and_gateway_option_per_role(monkeypatch, tiny_model):
    spec = _up_spec(
        monkeypatch,
        "--model", str(tiny_model), "--max-tokens", "50",
        "--worker-args", "--max-num-seqs 16 --kv-cache-gib 0.25",
        "--prefill-args", "--max-batch-tokens 4096 --kv-cache-gib 0.5",
        "--decode-args", "--max-model-len 512",
        "--colocated-args=--no-prefix-cache",  # one option alone: the = form (argparse)
        "--gateway-args", "--local-prefill-max-tokens 64 --routing load",
    )  # fmt: skip
    assert spec.worker_args == ("--max-num-seqs", "16", "--kv-cache-gib", "0.25")
    assert spec.prefill_args == ("--max-batch-tokens", "4096", "--kv-cache-gib", "0.5")
    assert spec.decode_args == ("--max-model-len", "512")
    assert spec.colocated_args == ("--no-prefix-cache",)
    # up's own gateway options first, the passed ones after them.
    assert spec.gateway_args[-4:] == ("--local-prefill-max-tokens", "64", "--routing", "load")
    assert "--max-tokens" in spec.gateway_args[:-4]


def test_up_refuses_options_a_process_does_not_take_before_starting_anything(tiny_model):
    for flag, value, message in [
        ("--decode-args", "--kv-cache-mb 16", "--decode-args '--kv-cache-mb 16': unrecognized"),
        ("--prefill-args", "--kv-cache-gib 0.5 --gpu-memory-utilization 1.5", "must be in (0, 1]"),
        ("--decode-args", "--tensor-parallel-size 2", "--decode-tp/--colocated-tp"),
        ("--colocated-args", "--role decode", "--role is set by the launcher"),
        ("--gateway-args", "--model /elsewhere", "--model is set by the launcher"),
        ("--gateway-args", "--local-prefill-max-tokens many", "invalid int value: 'many'"),
    ]:
        run = distserve("up", "--model", str(tiny_model), "--port", "0", flag, value)
        assert run.returncode == 2, (flag, value, run.stdout)
        assert f"distserve: error: {flag}" in run.stderr and message in run.stderr, run.stderr
        assert "gateway" not in run.stdout  # nothing started


def test_up_passes_etcd_gateways_and_planners_and_refuses_what_cannot_work(monkeypatch, tiny_model):
    spec = _up_spec(monkeypatch, "--model", str(tiny_model), "--gateways", "3")
    assert (spec.gateways, spec.etcd) == (3, None)  # None: the mesh starts its own etcd
    members = "http://10.0.0.5:2379,http://10.0.0.6:2379,http://10.0.0.7:2379"
    spec = _up_spec(monkeypatch, "--model", str(tiny_model), "--etcd", members, "--planners", "3")
    assert spec.etcd.endpoints == tuple(members.split(","))
    assert (spec.planner, spec.planners) == (True, 3)
    for argv, message in [
        (("--gateways", "0"), "--gateways must be at least 1"),
        (("--planners", "0"), "--planners must be at least 1"),
        (("--gateways", "2", "--no-edge"), "needs the edge"),
        (("--etcd", "https://etcd:2379"), "give --etcd-ca"),
        (("--etcd", "ftp://etcd:2379"), "--etcd takes http(s)://HOST:PORT"),
        (("--etcd-cert", "/c.pem"), "options of --etcd, which is not given"),
        (("--worker-args", "--etcd http://elsewhere:1"), "--etcd is set by the launcher"),
    ]:
        run = distserve("up", "--model", str(tiny_model), "--port", "0", *argv)
        assert run.returncode == 2 and message in run.stderr, (argv, run.stderr)
        assert "gateway" not in run.stdout  # nothing started


def test_version_is_the_one_the_package_declares_and_its_metadata_carries():
    init = Path(__file__).resolve().parent.parent / "distserve" / "__init__.py"
    declared = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M).group(1)
    assert importlib.metadata.version("distserve-mesh") == declared  # pyproject reads it
    shown = distserve("--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"distserve {declared}"
