"""Our model against Hugging Face transformers on the same random weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

VARIANTS = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "llama-mqa-llama3-rope": dict(
        architecture="LlamaForCausalLM", num_key_value_heads=1, rope_scaling=LLAMA3_ROPE
    ),
    "llama-linear-rope-tied": dict(
        architecture="LlamaForCausalLM",
        rope_scaling={"type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
    ),
    "qwen2-bias-tied": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
    # Qwen2.5's long-context setting: yarn, its attention factor scaling cos and sin.
    "qwen2-yarn-rope": dict(
        architecture="Qwen2ForCausalLM",
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=None),
}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: exactly n tokens."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=1,
        )
    return out[0, len(prompt) :].tolist()


def teacher_forced_logits(engine: LLMEngine, ids: list[int], prefill_len: int) -> torch.Tensor:
    """Logits after ids[:k] for k = prefill_len .. len(ids): one prefill, then decode steps fed
    the given ids instead of sampled ones. (len(ids) - prefill_len + 1, vocab)"""
    seq = Sequence(
        "forced",
        ids[:prefill_len],
        SamplingParams(max_tokens=len(ids)),
        eos_token_ids=(),
        max_context=engine.model_config.max_position_embeddings,
        tokenizer=None,
        default_seed=0,
    )
    assert engine._admit(seq, hold=False)
    out = [engine.runner.prefill([seq])[0]]
    engine.running.join(seq)
    for t in ids[prefill_len:]:
        seq.token_ids.append(t)
        assert not engine.running.reserve_next_slots()
        out.append(engine.runner.decode([seq])[0])
    engine.running.leave(seq)
    engine._free(seq)
    return torch.stack(out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_logits_match_transformers(model_factory, variant):
    path = model_factory(variant, **VARIANTS[variant])
    engine = LLMEngine(path, EngineConfig(num_blocks=64, block_size=16))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, engine.model_config.vocab_size, (300,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]  # (300, vocab)
    ours = teacher_forced_logits(engine, ids, prefill_len=200)  # logits at positions 199..299
    assert ours.shape == ref[199:].shape
    diff = (ours - ref[199:]).abs().max().item()
    assert diff <= 1e-4, f"max abs logit difference {diff}"


def test_greedy_batch_of_8_equals_transformers_generate(model_factory):
    path = model_factory("llama", **VARIANTS["llama"])
    engine = LLMEngine(path, EngineConfig(num_blocks=256))
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 3, 7, 16, 17, 40, 100, 250]
    prompts = [torch.randint(2, 900, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)  # all 8 run together
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} diverged"


def test_transposed_gemm_forms_match_transformers(model_factory):
    """The tiny model's weights are too small for the start-up tuning to pick the transposed
    GEMM form (services/engine/gemm.py), so force it on every layer for every decode-sized row
    count (some padded with zero rows), and check logits and a greedy batch against transformers."""
    path = model_factory("llama", **VARIANTS["llama"])
    engine = LLMEngine(path, EngineConfig(num_blocks=256))
    tunable = [m for m in engine.runner.model.modules() if hasattr(m, "gemm_plan")]
    assert len(tunable) == 4 * engine.model_config.num_layers + 1
    for m in tunable:
        m.gemm_plan = {1: 2, 2: 2, 3: 4, 4: 4, 5: 8, 6: 6, 7: 8, 8: 8}  # some padded
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(2, engine.model_config.vocab_size, (40,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = teacher_forced_logits(engine, ids, prefill_len=6)  # prefill and decode: <= 8 rows
    diff = (ours - ref[5:]).abs().max().item()
    assert diff <= 1e-4, f"max abs logit difference {diff}"
    prompts = [torch.randint(2, 900, (n,), generator=gen).tolist() for n in (3, 9, 30, 64)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt, res in zip(prompts, engine.generate(prompts, params), strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 16), f"prompt of {len(prompt)} diverged"
