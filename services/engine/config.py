"""Configuration of one engine instance."""

from __future__ import annotations

import argparse
import os
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
    tune_gemm: bool = True  # on CPU, time decode's small GEMM forms at start (engine/gemm.py)

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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_mb * 2**20,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            device=args.device,
            dtype=args.dtype,
            tune_gemm=args.tune_gemm,
        )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options every worker's command line takes."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="memory for the KV pool")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="prefill budget L_m")
    p.add_argument("--max-num-seqs", type=int, default=64, help="largest decode batch")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--no-tune-gemm",
        dest="tune_gemm",
        action="store_false",
        help="on CPU, skip timing the small-batch GEMM forms at start (about 2 s for a 100M "
        "model; decode at batch 2-4 can then be up to 2x slower)",
    )
    p.add_argument("--cpu", type=int, help="pin this process to one CPU core")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks of one instance (tensor parallelism): this process serves and starts the "
        "others; on CUDA, rank r uses GPU r",
    )


def configure_process(args: argparse.Namespace) -> None:
    """Pin the process to its core and set torch's thread count, as the options ask.

    Also shortens the interpreter's GIL switch interval (5 ms by default): the engine thread
    holds the GIL between torch kernels, and the event loop serving gRPC must get it promptly.
    """
    import sys

    import torch

    sys.setswitchinterval(0.0005)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.threads:
        torch.set_num_threads(args.threads)
