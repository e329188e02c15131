"""Penalties, logit_bias, min_tokens and min_p against transformers' `generate` with the
matching logits processors, on the same random weights (fp32, CPU), greedy."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import EOS_ID

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

NEW_TOKENS = 40


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens (not the prompt):
    logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len = prompt_len
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        scores = scores - self.frequency * counts
        return scores - self.presence * (counts > 0).to(scores.dtype)


def processors(prompt_len: int, p: SamplingParams) -> LogitsProcessorList:
    """transformers' processors for `p`, in vLLM's order (the engine's, sampler.py)."""
    procs = []
    if p.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, EOS_ID))
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in p.logit_bias]))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    if p.min_p:
        procs.append(MinPLogitsWarper(p.min_p))
    return LogitsProcessorList(procs)


def hf_generate(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    """transformers' greedy continuation with the processors of `p`; stops at EOS unless
    ignore_eos."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=p.max_tokens,
            do_sample=False,
            logits_processor=processors(len(prompt), p),
            eos_token_id=None if p.ignore_eos else EOS_ID,
            pad_token_id=EOS_ID,
        )
    return out[0, len(prompt) :].tolist()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(
        **{"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True} | kwargs
    )


# Repeats appear within 40 greedy tokens of the tiny random Llama, so every case below changes
# the output (checked against the unprocessed one), and each must equal transformers'.
CASES = {
    "repetition": greedy(repetition_penalty=1.3),
    "repetition-below-1": greedy(repetition_penalty=0.7),
    "presence-frequency": greedy(presence_penalty=0.8, frequency_penalty=0.6),
    "negative-frequency": greedy(frequency_penalty=-1.5),
    "logit-bias": greedy(logit_bias={417: -100, 26: -3.0, 910: 4.0}),
    "min-tokens": greedy(ignore_eos=False, min_tokens=20, logit_bias={EOS_ID: 8.0}),
    "all-with-min-p": greedy(
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.4,
        logit_bias={910: 2.0},
        min_p=0.2,
    ),
}
# Prompts whose plain greedy continuations repeat tokens.
PROMPTS = [[0, 100, 200, 300, 400], [0, 114, 222, 326], [0, 156, 288, 404]]


@pytest.fixture(scope="module")
def llama(model_factory):
    path = model_factory("llama", architecture="LlamaForCausalLM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return LLMEngine(path, EngineConfig(num_blocks=256)), hf


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_processors_equals_transformers_generate(llama, case):
    engine, hf = llama
    params = CASES[case]
    plain = engine.generate(PROMPTS, greedy(max_tokens=params.max_tokens))
    results = engine.generate(PROMPTS, params)  # the three prompts in one batch
    for prompt, res, base in zip(PROMPTS, results, plain, strict=True):
        assert res.token_ids == hf_generate(hf, prompt, params), f"prompt {prompt[:6]} diverged"
        assert res.token_ids != base.token_ids, "the processors changed nothing: a weak case"
    if params.min_tokens:  # EOS is the top token once allowed: it ends every answer there
        assert all(len(r.token_ids) == params.min_tokens + 1 for r in results)
        assert all(r.token_ids[-1] == EOS_ID for r in results)


def test_a_batch_of_mixed_processors_equals_each_request_alone_in_transformers(llama):
    """Every case and a plain greedy request in one batch: each row gets its own processors."""
    engine, hf = llama
    names = list(CASES)
    params = [CASES[n] for n in names] + [greedy()]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    results = engine.generate(prompts, params)
    for name, prompt, p, res in zip([*names, "plain"], prompts, params, results, strict=True):
        assert res.token_ids == hf_generate(hf, prompt, p), f"{name} diverged in the batch"
    assert engine.runner.token_counts.rows_in_use == 0
