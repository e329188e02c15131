"""The block pool: capacity accounting, reference counts, contiguous placement."""

from __future__ import annotations

import random

import pytest

from services.common.errors import OutOfKvBlocks
from services.engine.block_pool import BlockPool, BlockTable


def test_allocate_free_and_capacity():
    pool = BlockPool(10)
    a = pool.allocate(4)
    b = pool.allocate(6)
    assert pool.num_free == 0 and pool.num_used == 10
    assert sorted(a + b) == list(range(10))
    assert not pool.can_allocate(1)
    with pytest.raises(OutOfKvBlocks, match="1 blocks needed, 0 free"):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 4 and pool.can_allocate(4)
    pool.free(b)
    assert pool.free_runs() == [(0, 10)]


def test_a_new_sequence_gets_one_run_with_its_growth_left_free_behind_it():
    pool = BlockPool(100)
    first = pool.allocate(10, reserve=20)
    second = pool.allocate(10, reserve=20)
    assert first == list(range(70, 80)) and second == list(range(40, 50))
    # Each grows into the room behind it, one block at a time, staying one run.
    table = BlockTable()
    table.extend(first)
    for _ in range(20):
        table.extend(pool.allocate(1, after=table.last))
    assert table.runs == [[70, 30]]


def test_growth_past_a_neighbour_starts_a_new_run():
    pool = BlockPool(20)
    table = BlockTable()
    table.extend(pool.allocate(5))  # 15..19, the end of the pool
    table.extend(pool.allocate(1, after=table.last))
    assert len(table.runs) == 2 and table.blocks[:5] == [15, 16, 17, 18, 19]


def test_reference_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.free(blocks)
    assert pool.num_free == 2 and all(pool.ref_count(b) == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="freed more often than allocated"):
        pool.free(blocks[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.incref(blocks[:1])


def test_random_churn_keeps_accounting_exact():
    rng = random.Random(0)
    pool = BlockPool(257)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.45 or not pool.can_allocate(8)):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 8)
            held.append(pool.allocate(n, reserve=rng.randint(0, 4)))
        taken = [b for h in held for b in h]
        assert len(taken) == len(set(taken)) == pool.num_used
        free = sum(n for _, n in pool.free_runs())
        assert free == pool.num_free
    for h in held:
        pool.free(h)
    assert pool.free_runs() == [(0, 257)]
