"""Conditional disaggregation: the threshold from a profile, and short prompts prefilled on a
decode instance of a real mesh with exact output."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import InvalidRequest
from services.common.prefix_hash import block_hashes, cache_salt
from services.common.sampling import SamplingParams
from services.gateway.conditional import LocalPrefill
from services.gateway.prefix_index import CachedBlocks, PromptBlocks
from services.gateway.registry import Load, Registry
from services.gateway.request import Request
from services.gateway.routing import Routing
from tests.test_mesh import addresses, expected, generate, kv_all_free, stats, wait_until


def write_profile(tmp_path, prefill, small, large, threshold=8):
    path = tmp_path / "profile.json"
    tp1 = {
        "prefill": prefill,
        "decoding_smallbs": small,
        "decoding_largebs": large,
        "decoding_large_small_bs_threshold": threshold,
    }
    path.write_text(json.dumps({"format": "distserve-mesh-profile/1", "tp": {"1": tp1}}))
    return path


def test_the_threshold_is_the_longest_prefill_within_the_tpot_slack(tmp_path):
    # decode step at batch 16 (large regime), context 512: 2 + 0.0001 * 8192 + 0.1 * 16 = 4.4192
    # prefill(L) = 1 + 0.01 L + 0.0001 L^2 <= 20 - 4.4192 = 15.5808: L = 335 (336 gives 15.65)
    path = write_profile(tmp_path, [1, 0.01, 0.0001], [1, 0, 0], [2, 0.0001, 0.1])
    rule = LocalPrefill.from_profile(path, tpot_slo_ms=20)
    assert rule.max_tokens == 335
    assert rule.allows(335) and not rule.allows(336) and not rule.allows(0)
    # No slack (the decode step alone exceeds the SLO): never local.
    assert LocalPrefill.from_profile(path, tpot_slo_ms=4).max_tokens == 0
    # Capped by the model's context.
    assert LocalPrefill.from_profile(path, tpot_slo_ms=1e9, max_context=1024).max_tokens == 1024


def test_an_unreadable_profile_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(InvalidRequest, match="cannot read the latency profile"):
        LocalPrefill.from_profile(bad, tpot_slo_ms=50)


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_a_short_prompt_is_prefilled_on_decode_only_if_its_kv_fits_in_the_free_blocks(block_size):
    """Room on the decode instance is counted in its own block size (from its load report)."""
    registry = Registry(lease_s=60)
    registry.register("p", "prefill", "p:1", Load(total_kv_blocks=100, free_kv_blocks=100))
    free = Load(total_kv_blocks=100, free_kv_blocks=4, kv_block_size=block_size)
    registry.register("d", "decode", "d:1", free)
    routing = Routing(registry, local_prefill=LocalPrefill(1000, "test"))
    room = 4 * block_size  # tokens in the free blocks
    params = SamplingParams(max_tokens=8)
    fits = Request("fits", list(range(room - 9)), params, None)
    too_big = Request("too-big", list(range(room - 8)), params, None)
    assert routing.one_instance(fits, PromptBlocks(fits.prompt_ids)) is not None
    assert routing.one_instance(too_big, PromptBlocks(too_big.prompt_ids)) is None


def test_a_prompt_whose_uncached_part_is_short_is_prefilled_where_its_prefix_is_cached():
    """Conditional disaggregation counts the prompt tokens the decode instance would compute:
    a 1,010-token turn of a conversation whose first 1,000 tokens it holds is short there."""
    salt = cache_salt("m", "float32")
    registry = Registry(lease_s=60)
    registry.register("p", "prefill", "p:1", Load(total_kv_blocks=100, free_kv_blocks=100))
    load = Load(total_kv_blocks=1000, free_kv_blocks=500, kv_block_size=16)
    registry.register("d", "decode", "d:1", load, CachedBlocks(salt, 16))
    routing = Routing(registry, local_prefill=LocalPrefill(32, "test"))
    history = [5 + i % 900 for i in range(1008)]  # 63 full blocks
    turn = Request("turn", [*history, 1, 2, 3, 4], SamplingParams(max_tokens=8), None)
    assert routing.one_instance(turn, PromptBlocks(turn.prompt_ids)) is None
    registry.report("d", load, (False, block_hashes(history, 16, salt), ()))
    assert routing.one_instance(turn, PromptBlocks(turn.prompt_ids)) is not None


def test_short_prompts_are_prefilled_on_decode_long_ones_on_the_prefill_pool(
    mesh_factory, tiny_model
):
    mesh = mesh_factory(prefill=1, decode=1, gateway_args=("--local-prefill-max-tokens", "16"))
    prefill, decode = addresses(mesh, "prefill")[0], addresses(mesh, "decode")[0]
    short, long = "Hi there", "A longer prompt that the prefill pool should handle " * 3

    def served():
        return stats(prefill, "prefill").requests_total, stats(decode, "decode").requests_total

    p0, d0 = served()
    ids, _, _ = asyncio.run(generate(mesh.gateway_address, short))
    assert ids == expected(tiny_model, [short])[0][0]
    p1, d1 = served()
    assert (p1 - p0, d1 - d0) == (0, 1)  # prefilled and decoded on the decode instance
    assert stats(decode, "decode").pulls_total == 0
    ids, _, _ = asyncio.run(generate(mesh.gateway_address, long))
    assert ids == expected(tiny_model, [long])[0][0]
    p2, d2 = served()
    assert (p2 - p1, d2 - d1) == (1, 1)  # the prefill pool, then a pull
    wait_until(lambda: kv_all_free(mesh), what="KV freed on both sides")
