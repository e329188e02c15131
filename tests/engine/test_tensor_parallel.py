"""Tensor parallelism: TP=2 on CPU (gloo, two real processes) computes what TP=1 computes.

The two ranks are spawned once for the module; each runs the same engine calls (SPMD) and writes
its tokens, its KV cache and its layer-0 weight shards to a folder the tests compare with TP=1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from services.common.errors import InvalidRequest, UnsupportedModel
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.parallel import TensorParallel, spawn_ranks
from services.engine.shards import kv_heads_of
from tests.engine.families import write_family

TP = 2
# OPT (biases, learned positions), Qwen3 (q/k norms), Phi-3 (q/k/v and gate/up fused in the
# checkpoint: each part split on its own), Gemma 2 (soft caps, windows, GeGLU), Mixtral and
# Qwen3-MoE (every rank holds every expert's slice of the intermediate width), DeepSeek-V2
# (query heads split, the latent KV computed and cached whole on every rank; its routed and
# shared experts split by width, as the other MoE families').
TP_FAMILIES = ("opt", "qwen3", "phi3", "gemma2", "mixtral", "qwen3-moe", "deepseek-v2")
CONFIG = EngineConfig(num_blocks=64, block_size=8, max_batch_tokens=64)
PROMPTS = [[2 + (7 * i + n) % 1000 for i in range(n)] for n in (3, 17, 40, 70)]
GREEDY = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (12, 5, 9, 16)]
RANDOM = [
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, ignore_eos=True)
] * len(PROMPTS)


def _generate(engine: LLMEngine, params: list[SamplingParams]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(PROMPTS, params)]


def _generate_with_logits(
    engine: LLMEngine, params: list[SamplingParams]
) -> tuple[list[list[int]], torch.Tensor]:
    """Tokens, and the logits of every step (prefill and decode rows, in step order)."""
    steps: list[torch.Tensor] = []
    sample = engine.runner.sample

    def recording(logits: torch.Tensor, seqs: list) -> list[int]:
        steps.append(logits.clone())
        return sample(logits, seqs)

    engine.runner.sample = recording
    try:
        return _generate(engine, params), torch.cat(steps)
    finally:
        engine.runner.sample = sample


def _rank_main(tp: TensorParallel, models: dict[str, str], out: str) -> None:
    """One rank: every model, the same calls as TP=1; results into `out`."""
    torch.set_num_threads(1)
    for name, path in models.items():
        engine = LLMEngine(path, CONFIG, tp=tp)
        greedy, logits = _generate_with_logits(engine, GREEDY)
        tokens = {"greedy": greedy}
        kv = engine.runner.cache.data.clone()
        tokens["random"] = _generate(engine, RANDOM)
        Path(out, f"{name}-{tp.rank}.json").write_text(json.dumps(tokens))
        tensors = {"kv": kv, "logits": logits}
        if name == "tiny":
            attn = engine.runner.model.model.layers[0].self_attn
            tensors["qkv"] = attn.qkv_proj.weight.detach().clone()
            tensors["o"] = attn.o_proj.weight.detach().clone()
        save_file(tensors, str(Path(out, f"{name}-{tp.rank}.safetensors")))


def _odd_vocab_model(src: Path, dst: Path, vocab: int) -> Path:
    """`src` with vocab_size grown to an odd `vocab` (extra rows random): vocab-parallel
    shards then carry a padding row."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            t = tensors[name]
            extra = torch.randn((vocab - t.shape[0], t.shape[1]), generator=gen)
            tensors[name] = torch.cat([t, extra]).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    return dst


@pytest.fixture(scope="module")
def models(model_factory, tiny_model, tmp_path_factory) -> dict[str, Path]:
    # Llama with every bias (qkv column-parallel, o and down added once after the all-reduce),
    # tied embeddings, and a vocabulary tp does not divide.
    biased = model_factory(
        "tiny-tp-biased", attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    )
    odd = _odd_vocab_model(biased, tmp_path_factory.mktemp("tp") / "odd-vocab", 1025)
    # Every other family, as transformers writes it (tests/engine/families.py).
    others = {name: write_family(name, tmp_path_factory.mktemp(name)) for name in TP_FAMILIES}
    return {"tiny": tiny_model, "biased-tied-odd-vocab": odd, **others}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp-out")
    spawn_ranks(_rank_main, TP, {k: str(v) for k, v in models.items()}, str(out))
    return out


def _rank_result(runs: Path, name: str, rank: int) -> tuple[dict, dict[str, torch.Tensor]]:
    tokens = json.loads((runs / f"{name}-{rank}.json").read_text())
    return tokens, load_file(str(runs / f"{name}-{rank}.safetensors"))


@pytest.mark.parametrize("name", ["tiny", "biased-tied-odd-vocab", *TP_FAMILIES])
def test_tp2_gives_the_greedy_tokens_and_logits_of_tp1(models, runs, name):
    expected, logits = _generate_with_logits(LLMEngine(models[name], CONFIG), GREEDY)
    assert [len(t) for t in expected] == [p.max_tokens for p in GREEDY]
    for rank in range(TP):
        tokens, tensors = _rank_result(runs, name, rank)
        assert tokens["greedy"] == expected, f"rank {rank}"
        # Every prefill and decode step; only the order of the sums differs.
        torch.testing.assert_close(tensors["logits"], logits, rtol=1e-4, atol=1e-4)


def test_random_sampling_gives_every_rank_the_same_tokens(tiny_model, runs):
    # Identical per-request seeds and identical logits (after all-reduce / all-gather).
    engine = LLMEngine(tiny_model, CONFIG)
    greedy = _generate(engine, GREEDY)  # the same request ids as in the ranks
    expected = _generate(engine, RANDOM)
    pairs = zip(expected, greedy, strict=True)
    assert any(r[: len(g)] != g[: len(r)] for r, g in pairs)  # the draws matter
    ranks = [_rank_result(runs, "tiny", r)[0]["random"] for r in range(TP)]
    assert ranks[0] == ranks[1]
    assert ranks[0] == expected


def test_each_rank_caches_exactly_its_kv_heads_of_the_tp1_cache(tiny_model, runs):
    engine = LLMEngine(tiny_model, CONFIG)
    _generate(engine, GREEDY)
    full = engine.runner.cache.data  # (layers, 2, blocks, block_size, kv_heads, head_dim)
    num_kv_heads = engine.model_config.num_kv_heads
    written = full.abs().sum(dim=(0, 1, 3, 4, 5)) > 0  # blocks holding KV of the run
    assert written.sum() >= 15  # every prompt's blocks (136 prompt tokens, block_size 8)
    for rank in range(TP):
        _, tensors = _rank_result(runs, "tiny", rank)
        heads = kv_heads_of(rank, TP, num_kv_heads)
        kv = tensors["kv"]
        assert kv.shape == (*full.shape[:4], num_kv_heads // TP, full.shape[5])
        mine = full[:, :, :, :, heads.start : heads.stop]
        torch.testing.assert_close(kv, mine, rtol=1e-5, atol=1e-5)
        other = full[:, :, written][:, :, :, :, [h for h in range(num_kv_heads) if h not in heads]]
        assert not torch.allclose(kv[:, :, written], other, atol=1e-3)


def test_every_rank_caches_the_whole_latent_of_the_tp1_cache(models, runs):
    engine = LLMEngine(models["deepseek-v2"], CONFIG)
    _generate(engine, GREEDY)
    full = engine.runner.cache.data  # (layers, 1, blocks, block_size, 1, latent)
    assert full.shape[1] == 1 and full.shape[4] == 1
    assert (full.abs().sum(dim=(0, 1, 3, 4, 5)) > 0).sum() >= 15  # the prompts' blocks
    for rank in range(TP):
        _, tensors = _rank_result(runs, "deepseek-v2", rank)
        torch.testing.assert_close(tensors["kv"], full, rtol=1e-5, atol=1e-5)


def test_fused_weights_are_sharded_per_part(tiny_model, runs):
    ckpt = load_file(str(tiny_model / "model.safetensors"))
    mc = LLMEngine(tiny_model, EngineConfig(num_blocks=4)).model_config
    d, p = mc.head_dim, "model.layers.0.self_attn."
    for rank in range(TP):
        _, tensors = _rank_result(runs, "tiny", rank)
        q = slice(rank * mc.num_heads // TP * d, (rank + 1) * mc.num_heads // TP * d)
        kv = kv_heads_of(rank, TP, mc.num_kv_heads)
        kv = slice(kv.start * d, kv.stop * d)
        expected_qkv = torch.cat(
            [
                ckpt[p + "q_proj.weight"][q],
                ckpt[p + "k_proj.weight"][kv],
                ckpt[p + "v_proj.weight"][kv],
            ]
        )
        assert torch.equal(tensors["qkv"], expected_qkv)
        assert torch.equal(tensors["o"], ckpt[p + "o_proj.weight"][:, q])


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, r"tp=3 does not divide num_attention_heads \(4\)"),
        (4, r"tp=4 does not divide num_key_value_heads \(2\).*replicating KV heads"),
    ],
)
def test_tp_that_does_not_divide_the_heads_is_a_clear_error(tiny_model, tp, message):
    with pytest.raises(UnsupportedModel, match=message):
        LLMEngine(tiny_model, CONFIG, tp=TensorParallel(rank=0, world_size=tp))


def test_kv_heads_of():
    assert kv_heads_of(0, 1, 8) == range(0, 8)
    assert kv_heads_of(0, 2, 8) == range(0, 4)
    assert kv_heads_of(1, 2, 8) == range(4, 8)
    assert kv_heads_of(3, 4, 8) == range(6, 8)
    assert kv_heads_of(1, 2, 2) == range(1, 2)
    assert [h for r in range(4) for h in kv_heads_of(r, 4, 8)] == list(range(8))
    with pytest.raises(UnsupportedModel, match="tp=3 does not divide"):
        kv_heads_of(0, 3, 8)
    with pytest.raises(InvalidRequest, match="0 <= rank < tp"):
        kv_heads_of(2, 2, 8)


def test_tp1_calls_no_collective(tiny_model, monkeypatch):
    def collective(*args, **kwargs):
        raise AssertionError("a collective was called with tp == 1")

    for name in ("all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, collective)
    engine = LLMEngine(tiny_model, CONFIG)
    assert engine.kv_heads == range(engine.model_config.num_kv_heads)
    assert [len(t) for t in _generate(engine, GREEDY)] == [p.max_tokens for p in GREEDY]
    assert not dist.is_initialized()
