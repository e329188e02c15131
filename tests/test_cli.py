"""The `distserve` command line, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
