"""Configuration of one engine instance."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.model_config import DTYPES


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs its model.

    block_size: tokens per KV block. num_blocks: size of the KV pool; 0 sizes it from
    kv_cache_bytes. max_batch_tokens is L_m, the prefill token budget per batch (a longer prompt
    runs alone). max_num_seqs bounds the decode batch. dtype "auto" computes in the stored dtype on
    CUDA and in float32 on CPU (half-precision matmuls are slow there).
    """

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_bytes: int = 512 * 2**20
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    dtype: str = "auto"
    device: str = "auto"
    attention: str = "auto"  # auto | torch | flash
    seed: int = 0  # seeds requests that give no seed of their own

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequest(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 0 or self.kv_cache_bytes <= 0:
            raise InvalidRequest("num_blocks must be >= 0 and kv_cache_bytes > 0")
        if self.max_batch_tokens <= 0 or self.max_num_seqs <= 0:
            raise InvalidRequest("max_batch_tokens and max_num_seqs must be positive")
        if self.dtype not in ("auto", *DTYPES):
            raise InvalidRequest(f"dtype must be auto or one of {', '.join(DTYPES)}")
        if self.attention not in ("auto", "torch", "flash"):
            raise InvalidRequest("attention must be auto, torch or flash")
