"""Storage of the paged KV cache.

One tensor of shape (layers, 2, num_blocks, block_size, kv_heads, head_dim): for each layer, all
K blocks and then all V blocks. A run of consecutive blocks is therefore one contiguous byte
range per layer and per K/V, which the decode step reads in place and the KV-transfer service
sends and receives without reshuffling.

On the host the cache lives in memory the kernel may back with transparent huge pages
(`host_zeros`): a KV pull between two processes copies with one page-table walk per 2 MiB
instead of per 4 KiB, and the decode step's reads miss the TLB less.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

HUGE_PAGE = 2 * 2**20


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor whose pages the kernel may make transparent huge pages.

    Under the usual `madvise` setting of /sys/kernel/mm/transparent_hugepage/enabled only
    memory advised with MADV_HUGEPAGE gets them, and torch's allocator does not advise (unless
    THP_MEM_ALLOC_ENABLE=1, for every allocation of the process); `never` makes this a plain
    allocation. The tensor starts on a 2 MiB boundary and its pages are faulted in here, as
    torch.zeros would, so no decode step pays for a first touch.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # Private: shared anonymous memory is shmem, whose huge pages follow another setting
    # (shmem_enabled, usually never). The tensor keeps the mapping alive.
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(area, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    out = raw[skip : skip + nbytes].view(dtype).view(shape)
    out.zero_()
    return out


@dataclass(frozen=True)
class KvGeometry:
    """The KV an engine keeps per token, over all its ranks (a rank holds a share of the heads):
    what a KV handle describes, and what prefill and decode instances must agree on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class KvCache:
    """The KV blocks of every layer; block ids come from the BlockPool."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            self.data = host_zeros(shape, dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        tokens = num_blocks * block_size
        # Per layer: K and V as (num_blocks * block_size, kv_heads, head_dim) views, i.e. indexed
        # by cache slot = block * block_size + offset.
        self._flat = [
            (
                self.data[i, 0].view(tokens, num_kv_heads, head_dim),
                self.data[i, 1].view(tokens, num_kv_heads, head_dim),
            )
            for i in range(num_layers)
        ]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, each (num_blocks * block_size, kv_heads, head_dim)."""
        return self._flat[i]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.data.element_size()

    def region(self, layer: int, kv: int, first_block: int, num_blocks: int) -> torch.Tensor:
        """A contiguous view of `num_blocks` blocks from `first_block` of one layer's K (kv=0)
        or V (kv=1): (num_blocks, block_size, kv_heads, head_dim)."""
        return self.data[layer, kv, first_block : first_block + num_blocks]

    def write_tokens(self, layer: int, kv: int, blocks: list[int], tokens: torch.Tensor) -> None:
        """Write K (kv=0) or V of a sequence's first len(tokens) positions, (T, kv_heads,
        head_dim), into its blocks: the staged path for KV that arrives in another layout."""
        bs = self.block_size
        pos = torch.arange(tokens.shape[0], device=self.data.device)
        table = torch.tensor(blocks, device=self.data.device)
        slots = table[pos // bs] * bs + pos % bs
        self._flat[layer][kv].index_copy_(0, slots, tokens.to(self.data.dtype))

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, K and V."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * item
