"""Every model family against transformers, on checkpoints transformers writes (fp32, CPU).

For each family: logits of a prefill and of the decode steps after it within fp32 tolerance of
transformers' forward pass over the same tokens; greedy generation of a batch identical to
transformers' `generate` over 32 tokens; and a prompt served from the prefix cache identical to
one computed whole. Tensor parallelism: tests/engine/test_tensor_parallel.py; through the mesh:
tests/test_families_mesh.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.common.errors import InvalidRequest, UnsupportedModel
from services.common.model_config import ModelConfig
from services.common.sampling import SamplingParams
from services.engine.attention import make_backend
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from tests.engine.families import FAMILIES, write_family
from tests.engine.test_parity_transformers import hf_greedy, hf_model, teacher_forced_logits

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = write_family(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(family, name):
    path = family(name)
    engine = LLMEngine(path, EngineConfig(num_blocks=64, block_size=16, prefix_cache=False))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, engine.model_config.vocab_size, (120,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]  # (120, vocab)
    ours = teacher_forced_logits(engine, ids, prefill_len=70)  # positions 69..119
    assert ours.shape == ref[69:].shape
    diff = (ours - ref[69:]).abs().max().item()
    assert diff <= 1e-4, f"max abs logit difference {diff}"
    assert ref[69:].std() > 0.5  # logits well spread: a wrong model could not pass by luck


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_batch_equals_transformers_generate(family, name):
    path = family(name)
    engine = LLMEngine(path, EngineConfig(num_blocks=128, block_size=8))
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 900, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt, res in zip(prompts, engine.generate(prompts, params), strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} diverged"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefix_cache_gives_the_tokens_of_a_whole_prefill(family, name):
    path = family(name)
    engine = LLMEngine(path, EngineConfig(num_blocks=128, block_size=8, prefix_cache=True))
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 900, (33,), generator=gen).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.generate([[*shared, 5, 6, 7]], params)  # leaves 4 full blocks cached
    prompt = [*shared, 9, 10, 11, 12]
    rid = engine.add_request(prompt, params)
    tokens, cached, done = [], None, False
    while not done:
        for o in engine.step():
            assert o.request_id == rid
            cached = o.num_cached_tokens if cached is None else cached
            tokens += o.new_token_ids
            done = o.finished
    assert cached == 32  # the 4 shared blocks came from the cache
    assert tokens == hf_greedy(hf, prompt, 24)


def test_deepseek_v2_caches_one_latent_per_token_and_layer(family):
    path = family("deepseek-v2")
    engine = LLMEngine(path, EngineConfig(num_blocks=8, block_size=8))
    mc, raw = engine.model_config, engine.model_config.raw
    latent = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert engine.runner.cache.data.shape == (mc.num_layers, 1, 8, 8, 1, latent)
    assert mc.kv_bytes_per_token(4) == mc.num_layers * latent * 4  # not K and V heads


def test_deepseek_v2_refuses_what_it_does_not_implement_by_name(family):
    raw = json.loads((family("deepseek-v2") / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="mixture-of-experts layers"):
        ModelConfig.from_dict({**raw, "first_k_dense_replace": 1})
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModel, match="'yarn'"):
        ModelConfig.from_dict({**raw, "rope_parameters": yarn, "rope_scaling": None})
    with pytest.raises(InvalidRequest, match="cannot read a latent KV cache"):
        make_backend(
            "flash",
            num_heads=4,
            num_kv_heads=1,
            block_size=256,
            device=torch.device("cuda"),
            dtype=torch.float16,
            latent=True,
        )
