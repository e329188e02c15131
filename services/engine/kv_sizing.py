"""How large an engine's KV pool is, and the longest context it serves (max_model_len).

The pool is sized once at start, in this order:

1. `EngineConfig.num_blocks` (tests and tools that want an exact pool);
2. `EngineConfig.kv_cache_bytes` (`--kv-cache-gib`): an explicit size, on any device;
3. on CUDA, `gpu_memory_utilization` of the device (`--gpu-memory-utilization`, 0.9 as vLLM's):
   after the weights are loaded the engine runs its largest prefill and decode batches once, and
   what is left of `utilization * total` once everything in use on the device (weights, CUDA
   context, other processes) and that run's activation peak are set aside becomes KV blocks
   (`gpu_kv_bytes`, the arithmetic of nano-vllm's `allocate_kv_cache`);
4. on CPU, `cpu_kv_bytes`: min(4 GiB, a quarter of the host's available memory, what
   max_num_seqs sequences of max_model_len tokens hold). The host's memory is shared with
   everything else on it (other workers of the mesh, the tokenizer, the page cache that the
   weights were read through), and a CPU engine serves small batches of short contexts: a few
   GiB of KV outlasts what it can compute (4 GiB is also vLLM's CPU backend's KV default). A
   larger pool is one option away (`--kv-cache-gib`).

Then `max_model_len` (prompt + output of one request) is the model's `max_position_embeddings`
unless `--max-model-len` says less, capped by what one sequence can hold in the whole pool; a pool
that cannot hold two blocks refuses to start, naming the option to raise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

GIB = 2**30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
CPU_KV_MAX_BYTES = 4 * GIB
CPU_KV_FRACTION = 0.25
MIN_BLOCKS = 2  # fewer cannot hold a useful context


@dataclass(frozen=True)
class KvCapacity:
    """What an engine's pool holds, as it reports it (start-up line, registration, /metrics)."""

    num_blocks: int
    block_size: int
    max_model_len: int  # the longest prompt + output of one request, tokens
    max_model_len_capped: bool = False  # the pool, not the model, set max_model_len

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        capped = " (capped by the KV pool)" if self.max_model_len_capped else ""
        return (
            f"KV pool: {self.num_blocks} blocks of {self.block_size} tokens = {self.tokens} "
            f"tokens; max_model_len {self.max_model_len}{capped}"
        )


def gpu_kv_bytes(*, total: int, free: int, utilization: float, allocated: int, peak: int) -> int:
    """Bytes of KV a CUDA device can take after a profiling run (may be <= 0: none).

    total, free: `torch.cuda.mem_get_info` after the run (cache emptied), so `total - free` is
    everything held on the device now: this process's weights and CUDA context, and other
    processes. allocated: torch's allocated bytes before the run; peak: its peak during it, so
    `peak - allocated` is the run's activations, which steps will need again."""
    return int(total * utilization) - (total - free) - (peak - allocated)


def cpu_kv_bytes(available: int, world_size: int = 1, most: int | None = None) -> int:
    """The default KV bytes of one rank on CPU: min(4 GiB, a quarter of `available`) for the
    whole instance, shared by its `world_size` ranks (the ranks of a CPU group share a host, and
    each holds 1/world_size of the KV heads, so the instance holds as many tokens as at tp 1);
    and at most `most` bytes (what the largest decode batch can hold at the longest context:
    for a small model 4 GiB is millions of tokens, which only cost start-up time to zero)."""
    share = min(CPU_KV_MAX_BYTES, int(available * CPU_KV_FRACTION)) // world_size
    return share if most is None else min(share, most)


def mem_available() -> int:
    """Bytes of memory the host can give without swapping (/proc/meminfo MemAvailable; free
    pages where the kernel does not report it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_cuda(run: Callable[[], None], device: torch.device, utilization: float) -> int:
    """Run `run` (the engine's largest batches) once and return `gpu_kv_bytes` for `device`."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    allocated = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_bytes(
        total=total, free=free, utilization=utilization, allocated=allocated, peak=peak
    )


def capacity(
    num_blocks: int,
    block_size: int,
    model_max: int,
    requested: int = 0,
    raise_with: str = "--kv-cache-gib",
) -> KvCapacity:
    """The pool's capacity and max_model_len: `requested` (0: `model_max`, the model's
    max_position_embeddings), capped by the pool's tokens when not requested. InvalidRequest
    when the pool is under MIN_BLOCKS, or a requested length exceeds the model or the pool;
    `raise_with` names the option that gives the pool more memory."""
    tokens = num_blocks * block_size
    if num_blocks < MIN_BLOCKS:
        raise InvalidRequest(
            f"the KV pool holds {max(num_blocks, 0)} blocks of {block_size} tokens, too few to "
            f"serve a request (at least {MIN_BLOCKS}): raise {raise_with}"
        )
    if requested > model_max:
        raise InvalidRequest(
            f"--max-model-len {requested} is longer than the model's context "
            f"(max_position_embeddings {model_max})"
        )
    if requested > tokens:
        raise InvalidRequest(
            f"--max-model-len {requested} does not fit the KV pool ({num_blocks} blocks, "
            f"{tokens} tokens): lower --max-model-len or raise {raise_with}"
        )
    if requested:
        return KvCapacity(num_blocks, block_size, requested)
    return KvCapacity(num_blocks, block_size, min(model_max, tokens), tokens < model_max)
