"""Every model family through the mesh: a prompt prefilled on one process, its KV handed over
UCX to another that decodes, the tokens identical to transformers' greedy `generate` on the
checkpoint transformers wrote (tests/engine/families.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.tokenizer import Tokenizer
from tests.conftest import start_mesh, stop_now
from tests.engine.families import write_family
from tests.engine.test_parity_transformers import hf_greedy, hf_model
from tests.test_mesh import addresses, generate, kv_all_free, stats, wait_until

pytest.importorskip("transformers")

PROMPTS = [
    "Hello",
    # Longer than Gemma's and Mistral's test windows (8 tokens), and than a few KV blocks.
    "A longer prompt: " + "prefill reads the whole prompt at once and writes the cache; " * 3,
]


@pytest.mark.parametrize(
    "name",
    ["opt", "qwen3", "phi3", "gemma2", "mistral-window", "mixtral", "qwen3-moe", "deepseek-v2"],
)
def test_family_through_a_1p1d_mesh_equals_transformers(tmp_path, name):
    path = write_family(name, tmp_path / name)
    tokenizer = Tokenizer.from_dir(path)
    hf = hf_model(path)
    want = [hf_greedy(hf, tokenizer.encode(p), 24) for p in PROMPTS]
    mesh = start_mesh(path, prefill=1, decode=1)
    try:

        async def run_all():
            return await asyncio.gather(*(generate(mesh.gateway_address, p) for p in PROMPTS))

        for (ids, _, _), expected in zip(asyncio.run(run_all()), want, strict=True):
            assert ids == expected
        assert stats(addresses(mesh, "prefill")[0], "prefill").requests_total == len(PROMPTS)
        assert stats(addresses(mesh, "decode")[0], "decode").requests_total == len(PROMPTS)
        wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")
    finally:
        stop_now(mesh)
