"""Logprobs and prompt logprobs against transformers on the same random weights (fp32, CPU):
each generated token's log-probability, rank and top-k, teacher-forced over the sequence the
engine generated, are transformers' log_softmax of its logits at that position: the raw
distribution, before temperature, penalties and logit_bias (vLLM's raw_logprobs). Requests that
ask nothing get nothing and the same tokens."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequest
from services.common.logprobs import TokenLogprobs
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 100, 200, 300, 400, 500], [1, 114, 222, 326], [1, 156, 288, 404, 7, 9, 11]]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of `ids` (T, V), fp32."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine: LLMEngine, prompts, params) -> dict[str, dict]:
    """Each request's tokens, per-token logprobs and prompt logprobs, from the engine's steps."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    got = {rid: {"tokens": [], "logprobs": [], "prompt": None} for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            g = got[out.request_id]
            g["tokens"] += out.new_token_ids
            g["logprobs"] += out.logprobs or [None] * len(out.new_token_ids)
            if out.prompt_logprobs is not None:
                g["prompt"] = out.prompt_logprobs
    return [got[rid] for rid in ids]


def assert_matches(lp: TokenLogprobs, ref: torch.Tensor, token: int, k: int) -> None:
    """One position's logprobs equal the reference row's (ties in the top-k aside)."""
    assert lp.token_id == token
    assert abs(lp.logprob - float(ref[token])) < TOL
    assert (
        lp.rank == int((ref > ref[token] + TOL).sum()) + 1
        or abs(float(ref.sort(descending=True).values[lp.rank - 1]) - float(ref[token])) < TOL
    )
    want = ref.topk(k)
    assert len(lp.top_ids) == len(lp.top_logprobs) == k
    assert torch.allclose(torch.tensor(lp.top_logprobs), want.values, atol=TOL)
    # The ids may differ only where values tie: each id's reference logprob is its value.
    assert torch.allclose(ref[list(lp.top_ids)], want.values, atol=TOL)


CASES = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5),
    "chosen-only": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0),
    # Sampled with processors: the logprobs are still the raw distribution's.
    "sampled-processed": SamplingParams(
        max_tokens=12,
        temperature=1.7,
        top_k=40,
        seed=3,
        ignore_eos=True,
        repetition_penalty=1.5,
        frequency_penalty=1.0,
        logit_bias={5: 20.0},
        logprobs=20,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_logprobs_are_transformers_log_softmax_teacher_forced(tiny_model, hf, case):
    params = CASES[case]
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128))
    plain = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True)
    # One batch mixes rows that ask with rows that do not.
    results = run(engine, [*PROMPTS, PROMPTS[0]], [params] * len(PROMPTS) + [plain])
    for prompt, got in zip(PROMPTS, results, strict=False):
        ref = reference(hf, prompt + got["tokens"])
        assert len(got["logprobs"]) == len(got["tokens"]) == params.max_tokens
        for j, (token, lp) in enumerate(zip(got["tokens"], got["logprobs"], strict=True)):
            assert_matches(lp, ref[len(prompt) + j - 1], token, params.logprobs)
        assert got["prompt"] is None  # not asked
    assert all(lp is None for lp in results[-1]["logprobs"])
    if case == "greedy":  # asking changes no token
        assert results[-1]["tokens"][:6] == results[0]["tokens"][:6]


def test_prompt_logprobs_cover_every_prompt_position_even_with_a_cached_prefix(tiny_model, hf):
    """The first prompt token has none; every other is scored given the ones before it. A
    prompt whose prefix is cached is still computed whole (the cache would skip positions)."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=4))
    long_prompt = list(range(1, 40))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    run(engine, [long_prompt], SamplingParams(max_tokens=2, temperature=0.0))  # caches it
    [got] = run(engine, [long_prompt], params)
    ref = reference(hf, long_prompt)
    assert len(got["prompt"]) == len(long_prompt) - 1
    for i, lp in enumerate(got["prompt"], start=1):
        assert_matches(lp, ref[i - 1], long_prompt[i], 3)
    assert all(lp is None for lp in got["logprobs"])  # logprobs not asked


def test_prompt_logprobs_of_a_long_prompt_are_computed_in_chunks(tiny_model, hf, monkeypatch):
    from services.engine import sampler

    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_CHUNK_BYTES", 8 * 1024 * 7)  # 7 rows
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128))
    prompt = [1 + (i * 37) % 900 for i in range(50)]
    [got] = run(engine, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=1))
    ref = reference(hf, prompt + got["tokens"])
    assert [lp.token_id for lp in got["prompt"]] == prompt[1:]
    for i, lp in enumerate(got["prompt"], start=1):
        assert_matches(lp, ref[i - 1], prompt[i], 0)
    assert_matches(got["logprobs"][0], ref[len(prompt) - 1], got["tokens"][0], 1)


def test_k_above_20_is_refused_by_name():
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequest, match=rf"{name} must be an integer in \[0, 20\]") as e:
            SamplingParams(**{name: 21})
        assert e.value.param == name


def test_the_emulated_engine_refuses_logprobs_naming_itself(tmp_path):
    from services.common.model_spec import PRESETS
    from services.engine.config import Emulation
    from services.engine.presets import create_emulated

    folder = create_emulated(PRESETS["opt-13b"], tmp_path / "opt-13b")
    engine = LLMEngine(folder, EngineConfig(emulation=Emulation()), detokenize=False)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequest, match="not available on the emulated engine") as e:
            engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, **{name: 1}))
        assert e.value.param == name


TP_PARAMS = SamplingParams(
    max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=4, prompt_logprobs=2
)


def _tp_rank(tp, model: str, out: str) -> None:
    """One rank of a tp=2 engine: the same calls as tp=1, its logprobs into `out`. The prompt's
    run the LM head (an all-gather of the vocabulary's shards) chunk by chunk on every rank."""
    import json
    from pathlib import Path

    from services.engine import sampler

    torch.set_num_threads(1)
    sampler.PROMPT_LOGPROBS_CHUNK_BYTES = 8 * 1024 * 5  # several chunks, as a long prompt
    engine = LLMEngine(model, EngineConfig(num_blocks=64), tp=tp)
    got = run(engine, PROMPTS, TP_PARAMS)
    rows = [[g["tokens"], g["logprobs"], g["prompt"]] for g in got]
    Path(out, f"{tp.rank}.json").write_text(json.dumps(rows, default=vars))


def test_tp2_gives_the_logprobs_of_tp1(tiny_model, tmp_path):
    import json

    from services.engine.parallel import spawn_ranks

    spawn_ranks(_tp_rank, 2, str(tiny_model), str(tmp_path))
    want = run(LLMEngine(tiny_model, EngineConfig(num_blocks=64)), PROMPTS, TP_PARAMS)
    for rank in range(2):
        rows = json.loads((tmp_path / f"{rank}.json").read_text())
        for (tokens, logprobs, prompt), w in zip(rows, want, strict=True):
            assert tokens == w["tokens"], f"rank {rank}"
            pairs = [*zip(logprobs, w["logprobs"], strict=True),
                     *zip(prompt, w["prompt"], strict=True)]  # fmt: skip
            for got, lp in pairs:
                assert (got["token_id"], got["rank"], got["top_ids"]) == (
                    lp.token_id, lp.rank, list(lp.top_ids)
                )  # fmt: skip
                assert abs(got["logprob"] - lp.logprob) < TOL
                assert all(
                    abs(a - b) < TOL
                    for a, b in zip(got["top_logprobs"], lp.top_logprobs, strict=True)
                )
