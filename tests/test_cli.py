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
