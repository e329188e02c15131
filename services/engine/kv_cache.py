"""Storage of the paged KV cache.

One array of shape (layers, planes, num_blocks, block_size, kv_heads, head_dim): for each layer,
all K blocks and then all V blocks (planes 2), or the blocks of one latent vector per token
(planes 1: multi-head latent attention, kv_heads 1, head_dim the latent's width; see
docs/engine.md, "The latent KV cache"). A run of consecutive blocks is therefore one contiguous
byte range per layer and per plane, which the decode step reads in place and the KV-transfer
service sends and receives without reshuffling; neither needs to know which layout it moves.

The array is a torch tensor for the real engine (on its device), and a numpy array for the
emulated one, whose few bytes of payload per token need no torch: its process never imports
torch (about 200 MB less resident, 1.3 s less start-up). The block, region and slot logic is the
same for both; the dtype given says which (a torch dtype or a numpy one).

On the host the cache lives in memory the kernel may back with transparent huge pages
(`host_zeros`): a KV pull between two processes copies with one page-table walk per 2 MiB
instead of per 4 KiB, and the decode step's reads miss the TLB less.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from services.engine.shards import check_rank, kv_heads_of

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 * 2**20

# A torch dtype (the cache is a torch.Tensor) or a numpy one (a numpy array).
Dtype = Any


def host_zeros(shape: tuple[int, ...], dtype: Dtype) -> Any:
    """A zeroed host array whose pages the kernel may make transparent huge pages: a numpy
    array for a numpy dtype, else a torch tensor.

    Under the usual `madvise` setting of /sys/kernel/mm/transparent_hugepage/enabled only
    memory advised with MADV_HUGEPAGE gets them, and torch's allocator does not advise (unless
    THP_MEM_ALLOC_ENABLE=1, for every allocation of the process); `never` makes this a plain
    allocation. The array starts on a 2 MiB boundary and its pages are faulted in here, as
    torch.zeros would, so no decode step pays for a first touch.
    """
    numpy = _is_numpy(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        if numpy:
            return np.zeros(shape, dtype)
        import torch

        return torch.zeros(shape, dtype=dtype)
    # Private: shared anonymous memory is shmem, whose huge pages follow another setting
    # (shmem_enabled, usually never). The array keeps the mapping alive.
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(area, dtype=np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE
    raw = raw[skip : skip + nbytes]
    if numpy:
        out = raw.view(dtype).reshape(shape)
        out.fill(0)
        return out
    import torch

    out = torch.from_numpy(raw).view(dtype).view(shape)
    out.zero_()
    return out


@dataclass(frozen=True)
class KvGeometry:
    """The KV an engine keeps per token, over all its ranks: what a KV handle describes, and
    what prefill and decode instances must agree on.

    Per layer, `planes` arrays of num_kv_heads x head_dim entries: K and V (2), each rank
    holding a share of the heads; or one latent vector (`latent`: multi-head latent attention,
    1 plane of 1 head), which every rank holds whole, since every query head reads all of it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    latent: bool = False

    @property
    def planes(self) -> int:
        return 1 if self.latent else 2

    def heads_of(self, rank: int, tp: int) -> range:
        """The KV heads rank `rank` of `tp` holds (computes and caches): its share of K and V
        heads, or all of a latent."""
        if self.latent:
            check_rank(rank, tp)
            return range(self.num_kv_heads)
        return kv_heads_of(rank, tp, self.num_kv_heads)


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
        dtype: Dtype,
        device: torch.device | str = "cpu",
        planes: int = 2,
    ) -> None:
        """dtype: a torch dtype (the cache is a tensor on `device`) or a numpy dtype (a numpy
        array in host memory: `device` must be "cpu"). planes: 2 (K and V) or 1 (a latent)."""
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.planes = planes
        shape = (num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim)
        if getattr(device, "type", device) == "cpu":
            self.data = host_zeros(shape, dtype)
        else:
            import torch

            self.data = torch.zeros(shape, dtype=dtype, device=device)
        tokens = num_blocks * block_size
        # Per layer: each plane (K and V, or the latent) as a (num_blocks * block_size, kv_heads,
        # head_dim) view, i.e. indexed by cache slot = block * block_size + offset.
        self._flat = [
            tuple(self.data[i, p].reshape(tokens, num_kv_heads, head_dim) for p in range(planes))
            for i in range(num_layers)
        ]

    def layer(self, i: int) -> tuple[Any, ...]:
        """The planes of layer i (K and V, or the latent), each (num_blocks * block_size,
        kv_heads, head_dim)."""
        return self._flat[i]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's plane (its K, its V, or its latent)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.data.itemsize

    def region(self, layer: int, kv: int, first_block: int, num_blocks: int) -> Any:
        """A contiguous view of `num_blocks` blocks from `first_block` of one layer's plane `kv`
        (K 0, V 1; the latent 0): (num_blocks, block_size, kv_heads, head_dim)."""
        return self.data[layer, kv, first_block : first_block + num_blocks]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` into block `dst` in every layer and plane: a choice's own copy of
        the prompt's last partial block (copy-on-write when a request forks into n)."""
        self.data[:, :, dst] = self.data[:, :, src]

    def write_tokens(self, layer: int, kv: int, blocks: list[int], tokens: Any) -> None:
        """Write plane `kv` (K 0, V 1; the latent 0) of a sequence's first len(tokens)
        positions, (T, kv_heads, head_dim), into its blocks: the staged path for KV that
        arrives in another layout. `tokens` is an array of the cache's library."""
        bs = self.block_size
        flat = self._flat[layer][kv]
        if isinstance(flat, np.ndarray):
            pos = np.arange(tokens.shape[0])
            flat[np.asarray(blocks)[pos // bs] * bs + pos % bs] = tokens
            return
        import torch

        pos = torch.arange(tokens.shape[0], device=self.data.device)
        table = torch.tensor(blocks, device=self.data.device)
        slots = table[pos // bs] * bs + pos % bs
        flat.index_copy_(0, slots, tokens.to(self.data.dtype))

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Dtype,
        planes: int = 2,
    ) -> int:
        """Bytes one block takes across all layers and planes."""
        return planes * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def _is_numpy(dtype: Dtype) -> bool:
    return isinstance(dtype, np.dtype)
