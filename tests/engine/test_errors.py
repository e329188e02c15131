"""Bad input and bad model folders get typed errors with messages a person can act on."""

from __future__ import annotations

import json
import shutil

import pytest

from services.common.errors import InvalidRequest, ModelLoadError, UnsupportedModel
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(tiny_model, EngineConfig(num_blocks=128))


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.add_request([], SamplingParams())


def test_prompt_longer_than_the_context(engine):
    ctx = engine.model_config.max_position_embeddings
    with pytest.raises(InvalidRequest, match=f"serves at most {ctx} tokens"):
        engine.add_request([5] * ctx, SamplingParams())
    with pytest.raises(InvalidRequest, match=r"set max_tokens <= 24"):
        engine.add_request([5] * (ctx - 24), SamplingParams(max_tokens=100))


def test_token_ids_outside_the_vocabulary(engine):
    with pytest.raises(InvalidRequest, match=r"integers in \[0, "):
        engine.add_request([1, -1], SamplingParams())
    with pytest.raises(InvalidRequest, match=r"integers in \[0, "):
        engine.add_request([10**9], SamplingParams())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": -3}, "max_tokens must be >= 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, r"top_k must be an integer in \[0, 4294967295\]"),
        ({"top_k": 2**32}, r"top_k must be an integer in \[0, 4294967295\]"),
        ({"seed": -1}, "seed must be an integer"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": ["x"] * 17}, "at most 16 stop strings"),
    ],
)
def test_invalid_sampling_parameters(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def copy_model(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_names_the_supported_ones(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    names = r"supported: LlamaForCausalLM, .*Qwen2ForCausalLM.*OPTForCausalLM"
    with pytest.raises(UnsupportedModel, match=names):
        LLMEngine(path)


def test_unsupported_rope_scaling(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedModel, match="'dynamic'; supported: default, linear, llama3, yarn"
    ):
        LLMEngine(path)


def test_missing_weights(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"expected model\.safetensors"):
        LLMEngine(path)


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        LLMEngine(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(tmp_path / "nowhere")


def test_truncated_weights(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        LLMEngine(path)


def test_garbage_weights(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    (path / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!rest"
    )
    with pytest.raises(ModelLoadError, match="header is not JSON"):
        LLMEngine(path)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="header length"):
        LLMEngine(path)


def test_weights_that_do_not_match_the_config(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="has shape"):
        LLMEngine(path)
    cfg["intermediate_size"] -= 8
    cfg["num_hidden_layers"] += 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"lacks model\.layers\.2\."):
        LLMEngine(path)


def test_corrupt_config(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    (path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLMEngine(path)


def test_a_request_larger_than_the_whole_kv_pool_is_refused(tiny_model):
    """The pool (4 blocks of 16 tokens) caps max_model_len below the model's 1024 tokens."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=4, block_size=16))
    assert engine.max_model_len == 64
    message = r"\(60 tokens\) \+ max_tokens \(10\) exceeds max_model_len \(64 tokens\); set max"
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request([5] * 60, SamplingParams(max_tokens=10))
    engine.add_request([5] * 54, SamplingParams(max_tokens=10))  # 64 tokens: fits exactly


def test_tokenizer_larger_than_the_model_vocabulary(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = 500
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do not belong to the same model"):
        LLMEngine(path)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU refusal")
def test_flash_attention_without_cuda_is_refused(tiny_model):
    with pytest.raises(InvalidRequest, match="needs a CUDA device and the flash_attn package"):
        LLMEngine(tiny_model, EngineConfig(attention="flash"))
