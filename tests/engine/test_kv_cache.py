"""The KV cache's host memory: zeroed, 2 MiB aligned, backed by huge pages where the kernel
allows, and alive as long as a view of it is."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from services.engine.kv_cache import HUGE_PAGE, KvCache, host_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` in this process (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= address < int(m[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def cache(num_blocks: int) -> KvCache:
    return KvCache(
        num_layers=2,
        num_blocks=num_blocks,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_a_host_cache_is_zeroed_aligned_and_kept_alive_by_its_views() -> None:
    kv = cache(512)  # 2 layers x K/V x 512 blocks x 8 KiB = 16 MiB
    assert kv.data.shape == (2, 2, 512, 16, 2, 64)
    assert kv.data.dtype == torch.float32 and kv.data.is_contiguous()
    assert kv.data.data_ptr() % HUGE_PAGE == 0
    assert not kv.data.any()
    region = kv.region(1, 1, 500, 12)
    del kv
    gc.collect()
    region.fill_(3.0)  # the memory is still mapped: no crash, the values stick
    assert region.sum().item() == 3.0 * region.numel()


def test_small_and_odd_sizes_fall_back_to_a_plain_tensor() -> None:
    small = host_zeros((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and not small.any()
    odd = host_zeros((3, HUGE_PAGE + 7), torch.uint8)
    assert odd.shape == (3, HUGE_PAGE + 7) and not odd.any()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(),
    reason="the kernel gives no transparent huge pages here",
)
def test_a_host_cache_gets_huge_pages() -> None:
    """What a KV pull between processes copies faster (`bench/experiments/kvtransfer_ab.py`: 64 MiB
    25% faster than from torch's own allocation)."""
    kv = cache(2048)  # 64 MiB
    assert anon_huge_kb(kv.data.data_ptr()) >= HUGE_PAGE // 1024
    plain = torch.zeros(kv.data.shape, dtype=kv.data.dtype)  # what the cache was before
    if "[madvise]" in THP.read_text():
        assert anon_huge_kb(plain.data_ptr()) == 0
