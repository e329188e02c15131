"""Rotary scalings against transformers' own: `ROPE_INIT_FUNCTIONS` on the same config gives
the inverse frequencies and the attention factor our rope.py computes from our ModelConfig."""

from __future__ import annotations

import pytest
import torch

from services.common.model_config import ModelConfig
from services.engine.rope import attention_factor, inverse_frequencies, softmax_mscale

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import (  # noqa: E402
    ROPE_INIT_FUNCTIONS,
    yarn_apply_mscale,
)

SCALINGS = {
    "yarn-mscales-differ": {
        "rope_type": "yarn",
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    "yarn-deepseek-v2": {  # DeepSeek-V2's own: equal mscales, factor 40 of a 4k context
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "yarn-qwen2.5": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 2.0, "truncate": False},
    "yarn-explicit-attention-factor": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.3,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-factor-from-contexts": {
        "rope_type": "yarn",
        "factor": None,
        "original_max_position_embeddings": 128,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_frequencies_and_attention_factor_are_transformers(name):
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,  # head_dim 64: 32 frequencies, the ramp inside them
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, **SCALINGS[name]},
    )
    raw = {**config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    rope = ModelConfig.from_dict(raw).rope
    inv_freq, factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)
    ours = inverse_frequencies(rope, 64)
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    assert attention_factor(rope) == pytest.approx(factor, rel=1e-12)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    assert not torch.allclose(ours, plain)  # the scaling did change the frequencies
    if SCALINGS[name]["factor"] is None:
        assert rope.factor == 512 / 128  # max_position_embeddings / original context
    if rope.type == "yarn":
        expected = yarn_apply_mscale(config.rope_parameters, 1.0)
        assert softmax_mscale(rope) == pytest.approx(expected, rel=1e-12)
