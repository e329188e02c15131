"""A latent-KV model (DeepSeek-V2's multi-head latent attention) handed over between instances
of different tensor-parallel degrees: real processes, the tiny checkpoint transformers wrote.
Every rank holds the whole latent, so each decode rank pulls all of it, from the first prefill
rank (the others hold the same bytes and are not asked)."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import start_mesh
from tests.engine.families import write_family
from tests.engine.test_parity_transformers import hf_greedy, hf_model
from tests.test_mesh import kv_all_free, wait_until
from tests.tp.test_tp_mesh import MAX_TOKENS, TP2, _address, _by_rank, _handoff, _minus

pytest.importorskip("transformers")

PROMPTS = [[5 + (i * 7) % 300 for i in range(37)], [9 + (i * 13) % 400 for i in range(21)]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_family("deepseek-v2", tmp_path_factory.mktemp("deepseek-v2"))


@pytest.fixture(scope="module")
def mesh(model):
    workers = {"prefill-1": TP2, "decode-1": TP2}
    mesh = start_mesh(model, prefill=2, decode=2, per_worker_args=workers)
    yield mesh
    mesh.stop()


@pytest.mark.parametrize(
    ("case", "prefill", "decode"),
    [(1, "prefill-1", "decode-0"), (2, "prefill-0", "decode-1"), (3, "prefill-1", "decode-1")],
    ids=["P-tp2-D-tp1", "P-tp1-D-tp2", "P-tp2-D-tp2"],
)
def test_every_decode_rank_pulls_the_whole_latent(mesh, model, case, prefill, decode):
    hf = hf_model(model)
    # Prompts of their own per case: no decode instance holds a prefix of them.
    prompts = [[t + case for t in p] for p in PROMPTS]
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    d = 2 if decode == "decode-1" else 1
    served, pulled = _by_rank(mesh, prefill), _by_rank(mesh, decode)

    async def both():
        return await asyncio.gather(
            *(
                _handoff(_address(mesh, prefill), _address(mesh, decode), f"{case}-{i}", p, False)
                for i, p in enumerate(prompts)
            )
        )

    total = 0
    for (tokens, handle), expected in zip(asyncio.run(both()), want, strict=True):
        assert tokens == expected
        assert (handle.kv_planes, handle.num_kv_heads) == (1, 1)
        total += handle.total_bytes
    assert _minus(_by_rank(mesh, decode), pulled) == [total] * d  # each rank: all of it
    p = len(served)
    wait_until(
        lambda: _minus(_by_rank(mesh, prefill), served) == [d * total] + [0] * (p - 1),
        what="prefill rank 0 to have served the latent once per decode rank",
    )
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")
