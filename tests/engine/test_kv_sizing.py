"""The KV pool's size and max_model_len: the sizing arithmetic with numbers (the CUDA path's
too, which needs no device to check), and engines sized by it on CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.common.errors import InvalidRequest
from services.common.sampling import FinishReason, SamplingParams
from services.engine import kv_sizing
from services.engine.config import EngineConfig, add_engine_args
from services.engine.engine import LLMEngine
from services.engine.kv_sizing import GIB, capacity, cpu_kv_bytes, gpu_kv_bytes

MIB = 2**20


def test_gpu_kv_bytes_is_what_the_utilization_leaves_after_weights_others_and_activations():
    # An 80 GiB device: 16 GiB of weights + 1 GiB of CUDA context held by this process, 3 GiB
    # by another process (total - free = 20 GiB), and a profiling run that peaked 5 GiB above
    # what was allocated before it. 0.9 x 80 = 72 GiB, less 20 and 5: 47 GiB of KV.
    kv = gpu_kv_bytes(
        total=80 * GIB, free=60 * GIB, utilization=0.9, allocated=16 * GIB, peak=21 * GIB
    )
    assert kv == 72 * GIB - 20 * GIB - 5 * GIB
    # Others holding more than the utilization leaves: no KV (the engine refuses to start).
    assert gpu_kv_bytes(total=80 * GIB, free=5 * GIB, utilization=0.9, allocated=0, peak=0) < 0


def test_cpu_default_is_a_quarter_of_available_memory_at_most_4_gib_shared_by_the_ranks():
    assert cpu_kv_bytes(8 * GIB) == 2 * GIB
    assert cpu_kv_bytes(64 * GIB) == 4 * GIB
    assert cpu_kv_bytes(64 * GIB, world_size=2) == 2 * GIB
    assert cpu_kv_bytes(64 * GIB, most=100 * MIB) == 100 * MIB
    assert kv_sizing.mem_available() > 0


def test_max_model_len_is_the_models_capped_by_the_pool():
    assert capacity(4096, 16, 1024) == kv_sizing.KvCapacity(4096, 16, 1024, False)
    small = capacity(40, 16, 1024)
    assert (small.tokens, small.max_model_len, small.max_model_len_capped) == (640, 640, True)
    assert capacity(4096, 16, 1024, requested=300).max_model_len == 300


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 16, 1024), r"holds 1 blocks of 16 tokens, too few .* raise --kv-cache-gib"),
        ((0, 16, 1024), r"holds 0 blocks"),
        ((64, 16, 1024, 2048), r"--max-model-len 2048 is longer than the model's context"),
        ((64, 16, 1024, 1025), r"longer than the model's context \(max_position_embeddings"),
        ((8, 16, 1024, 200), r"--max-model-len 200 does not fit the KV pool \(8 blocks, 128 "),
    ],
)
def test_a_pool_too_small_or_a_length_too_long_is_refused_naming_the_option(args, message):
    with pytest.raises(InvalidRequest, match=message):
        capacity(*args)


def _block_bytes(engine: LLMEngine) -> int:
    mc = engine.model_config
    return 2 * mc.num_layers * engine.block_size * mc.num_kv_heads * mc.head_dim * 4  # float32


def test_kv_cache_gib_sizes_the_pool_exactly(tiny_model):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    config = EngineConfig.from_args(p.parse_args(["--kv-cache-gib", "0.005"]))
    assert config.kv_cache_bytes == int(0.005 * GIB)
    engine = LLMEngine(tiny_model, config)
    assert engine.pool.num_blocks == int(0.005 * GIB) // _block_bytes(engine)
    assert engine.runner.cache.data.nbytes == engine.pool.num_blocks * _block_bytes(engine)
    assert engine.capacity.tokens == engine.pool.num_blocks * 16
    assert engine.max_model_len == engine.model_config.max_position_embeddings  # 1024 fits


def test_the_cpu_default_pool_holds_the_largest_decode_batch_at_the_longest_context(tiny_model):
    # The tiny model's KV is 512 B a token: a quarter of the host is far more than
    # max_num_seqs sequences of its 1024 tokens, which bound the default.
    engine = LLMEngine(tiny_model, EngineConfig(max_num_seqs=8))
    assert engine.pool.num_blocks == 8 * 1024 // 16
    assert engine.max_model_len == 1024


def test_a_pool_smaller_than_the_context_caps_max_model_len_and_the_requests(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=20 * 8192))  # 20 blocks of 16
    assert engine.pool.num_blocks == 20 and engine.max_model_len == 320
    with pytest.raises(InvalidRequest, match=r"serves at most 320 tokens \(max_model_len\)"):
        engine.add_request([5] * 320, SamplingParams())
    engine.add_request([5] * 300, SamplingParams(max_tokens=20))


def test_max_model_len_bounds_prompt_and_output(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, max_model_len=100))
    assert engine.max_model_len == 100 and not engine.capacity.max_model_len_capped
    with pytest.raises(InvalidRequest, match=r"exceeds max_model_len \(100 tokens\)"):
        engine.add_request([5] * 90, SamplingParams(max_tokens=11))
    done = engine.generate([[5] * 90], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(done.token_ids) == 10 and done.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kv_cache_bytes": 8192}, r"holds 1 blocks .* raise --kv-cache-gib"),
        ({"gpu_memory_utilization": 0.5}, r"this engine runs on CPU: size it with --kv-cache-gib"),
        ({"kv_cache_bytes": GIB, "gpu_memory_utilization": 0.5}, r"not both"),
        ({"num_blocks": 64, "max_model_len": 2000}, r"longer than the model's context"),
    ],
)
def test_engines_that_cannot_size_their_pool_refuse_to_start(tiny_model, config, message):
    with pytest.raises(InvalidRequest, match=message):
        LLMEngine(tiny_model, EngineConfig(**config))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"gpu_memory_utilization": 1.5}, r"--gpu-memory-utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 0.0}, r"--gpu-memory-utilization must be in \(0, 1\]"),
        ({"kv_cache_bytes": 0}, r"--kv-cache-gib\) > 0"),
        ({"max_model_len": -1}, r"--max-model-len must be >= 0"),
    ],
)
def test_bad_sizing_options_are_refused(config, message):
    with pytest.raises(InvalidRequest, match=message):
        EngineConfig(**config)


def test_the_profiling_run_works_on_a_tiny_pool(tiny_model):
    """The CUDA sizing path runs the largest batches on a pool of one block (every block id
    0); the same code runs on CPU, so its bookkeeping is checked here (on two blocks, the
    smallest pool an engine starts with)."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=2, max_num_seqs=4))
    engine.runner.profile(700)


def _rank_pool(tp, model: str, out: str) -> None:
    # Rank r is given (r + 1) x 20 blocks' worth (a rank's block holds its half of the heads).
    engine = LLMEngine(model, EngineConfig(kv_cache_bytes=(tp.rank + 1) * 20 * 4096), tp=tp)
    Path(out, f"rank{tp.rank}").write_text(f"{engine.pool.num_blocks} {engine.max_model_len}")


def test_the_ranks_of_a_group_hold_the_smallest_pool_any_of_them_measured(tiny_model, tmp_path):
    from services.engine.parallel import spawn_ranks

    spawn_ranks(_rank_pool, 2, str(tiny_model), str(tmp_path))
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["20 320", "20 320"]
