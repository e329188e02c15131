"""Checkpoint loading: sharded or single file, any stored dtype, one copy in memory."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from services.common.errors import ModelLoadError
from services.common.model_config import ModelConfig
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.weights import load_model

from .test_parity_transformers import hf_model, teacher_forced_logits

IDS = list(range(2, 60))


def test_sharded_checkpoint_loads_the_same_model(model_factory, tiny_model):
    sharded = model_factory("tiny-sharded", shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    a = LLMEngine(tiny_model, EngineConfig(num_blocks=32))
    b = LLMEngine(sharded, EngineConfig(num_blocks=32))
    assert torch.equal(teacher_forced_logits(a, IDS, 50), teacher_forced_logits(b, IDS, 50))


def test_sharded_index_naming_a_missing_shard(model_factory, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(model_factory("tiny-sharded", shards=3), path)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"00002-of-00003\.safetensors, which is missing"):
        LLMEngine(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_match_transformers(model_factory, dtype):
    path = model_factory(f"tiny-{dtype}", dtype=dtype)
    engine = LLMEngine(path, EngineConfig(num_blocks=32))
    assert engine.dtype == torch.float32  # CPU computes in float32 (auto)
    ref = hf_model(path)  # upcasts the same stored weights to float32
    with torch.no_grad():
        expected = ref(torch.tensor([IDS])).logits[0, 49:]
    got = teacher_forced_logits(engine, IDS, 50)
    assert (got - expected).abs().max().item() <= 1e-4


def test_bfloat16_compute_stays_close_to_float32(model_factory):
    path = model_factory("tiny-bfloat16", dtype="bfloat16")
    f32 = teacher_forced_logits(LLMEngine(path, EngineConfig(num_blocks=32)), IDS, 50)
    bf16 = LLMEngine(path, EngineConfig(num_blocks=32, dtype="bfloat16"))
    assert bf16.runner.model.lm_head.weight.dtype == torch.bfloat16
    got = teacher_forced_logits(bf16, IDS, 50)
    assert (got.argmax(-1) == f32.argmax(-1)).float().mean() > 0.8
    assert (got - f32).abs().max() < 0.5


LOAD_AND_MEASURE = """
import sys, torch
from services.common.model_config import ModelConfig
from services.engine import models
from services.engine.weights import load_model

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
cfg = ModelConfig.from_dir(path)
# The first model built and the first parameter moved off the meta device set up torch
# internals (~80 MB and ~36 MB): not weights.
with torch.device("meta"):
    models.build(cfg)
    first = torch.nn.Linear(1, 1)
first.to_empty(device="cpu")
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
model = load_model(path, cfg, torch.float32, torch.device("cpu"))
print(rss("VmHWM:") - before)
"""


def test_loading_holds_one_copy_of_the_weights(model_factory):
    # About 50 MB of float32 weights: large enough that a second copy would show in peak RSS.
    path = model_factory(
        "mem",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    weight_bytes = (path / "model.safetensors").stat().st_size
    assert weight_bytes > 40e6
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_MEASURE, str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    peak_growth = int(out.stdout.strip())
    assert peak_growth < 1.25 * weight_bytes, (peak_growth, weight_bytes)


def test_loaded_parameters_are_the_checkpoint_tensors(tiny_model):
    from safetensors.torch import load_file

    ref = load_file(str(tiny_model / "model.safetensors"))
    model = load_model(
        tiny_model, ModelConfig.from_dir(tiny_model), torch.float32, torch.device("cpu")
    )
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, ref["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, ref["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, ref["model.layers.1.self_attn.v_proj.weight"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, ref["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, ref["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])
