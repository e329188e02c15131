"""Configuration of one engine instance: the real (torch) engine, or the emulated one."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.model_config import DTYPES

ENGINES = ("torch", "emulated")
DEFAULT_MAX_BATCH_TOKENS = 2048  # L_m of the real engine unless given
PROFILE_FITS = ("distserve", "vllm")


@dataclass(frozen=True)
class Emulation:
    """What an emulated engine models (services/engine/emulated.py, docs/engine.md): the model
    folder's shape on `tp` devices of `gpu_memory_gib` each, stepping as the latency profile says.

    profile: a latency profile file (`distserve profile` output, or DistServe's published JSON);
    None: DistServe's published A100 profile, scaled for models it lacks. profile_fit: which fit
    of a published file: `distserve` (its disaggregated engine) or `vllm` (the colocated
    baseline's, as the planner times colocated instances). link_gbs: the bandwidth KV arrives
    over at this instance (GB/s; 300: NVLink, 25: PCIe, 3.1: 25 Gb/s between nodes).
    """

    profile: str | None = None
    profile_fit: str = "distserve"
    gpu_memory_gib: float = 80.0
    memory_utilization: float = 0.92
    tp: int = 1
    link_gbs: float = 300.0

    def __post_init__(self) -> None:
        if self.profile_fit not in PROFILE_FITS:
            raise InvalidRequest(f"profile fit must be one of {', '.join(PROFILE_FITS)}")
        if self.gpu_memory_gib <= 0 or not 0 < self.memory_utilization <= 1:
            raise InvalidRequest("gpu memory must be positive and its utilization in (0, 1]")
        if self.tp < 1 or self.link_gbs <= 0:
            raise InvalidRequest("an emulated instance needs tp >= 1 and a positive link")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs its model.

    block_size: tokens per KV block. num_blocks: size of the KV pool; 0 sizes it from
    kv_cache_bytes, or (None) from the device: gpu_memory_utilization of a CUDA device (None:
    0.9), a default share of the host's memory on CPU (services/engine/kv_sizing.py).
    max_model_len: the longest prompt + output served; 0: the model's, capped by the pool.
    max_batch_tokens is L_m, the prefill token budget per batch (a longer prompt
    runs alone); 0: DEFAULT_MAX_BATCH_TOKENS for the real engine, and for an emulated one its
    profile's saturation point at its tensor degree (as the planner sets it), so an instance
    started at another tp batches as that tp should. max_num_seqs bounds the decode batch. dtype
    "auto" computes in the stored dtype on CUDA and in float32 on CPU (half-precision matmuls
    are slow there). prefix_cache: keep the KV of full blocks after their request and reuse it
    for prompts that share the prefix (services/engine/engine.py).
    """

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_bytes: int | None = None  # None: sized from the device (above)
    gpu_memory_utilization: float | None = None  # CUDA, and an emulated device; None: default
    max_model_len: int = 0  # 0: the model's max_position_embeddings, capped by the pool
    max_batch_tokens: int = 0  # 0: auto (above)
    max_num_seqs: int = 64
    dtype: str = "auto"
    device: str = "auto"
    attention: str = "auto"  # auto | torch | flash
    seed: int = 0  # seeds requests that give no seed of their own
    tune_gemm: bool = True  # on CPU, time decode's small GEMM forms at start (engine/gemm.py)
    prefix_cache: bool = True  # reuse the KV of cached full blocks of a prompt's prefix
    emulation: Emulation | None = None  # set: the emulated engine (no weights, modelled steps)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequest(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 0 or (self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0):
            raise InvalidRequest("num_blocks must be >= 0 and the KV cache (--kv-cache-gib) > 0")
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise InvalidRequest(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        if self.max_model_len < 0:
            raise InvalidRequest("--max-model-len must be >= 0 (0: the model's, capped by KV)")
        if self.emulation is not None and self.kv_cache_bytes is not None:
            raise InvalidRequest(
                "--kv-cache-gib sizes a real engine's pool; an emulated engine's KV is what its "
                "modelled device leaves: set --gpu-memory-gib or --gpu-memory-utilization"
            )
        if self.max_batch_tokens < 0 or self.max_num_seqs <= 0:
            raise InvalidRequest("max_batch_tokens must be >= 0 (0: auto), max_num_seqs positive")
        if self.dtype not in ("auto", *DTYPES):
            raise InvalidRequest(f"dtype must be auto or one of {', '.join(DTYPES)}")
        if self.attention not in ("auto", "torch", "flash"):
            raise InvalidRequest("attention must be auto, torch or flash")

    @classmethod
    def from_args(cls, args: argparse.Namespace, profile_fit: str = "distserve") -> EngineConfig:
        """The options of `add_engine_args`; `profile_fit`: the published fit an emulated
        engine steps by unless --profile-fit names one."""
        emulation = None
        utilization = {}
        if args.gpu_memory_utilization is not None:
            utilization["memory_utilization"] = args.gpu_memory_utilization
        if args.engine == "emulated":
            emulation = Emulation(
                profile=args.profile,
                profile_fit=args.profile_fit or profile_fit,
                gpu_memory_gib=args.gpu_memory_gib,
                **utilization,
                tp=args.tensor_parallel_size,
                link_gbs=args.link_gbs,
            )
        return cls(
            block_size=args.block_size,
            kv_cache_bytes=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30),
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            device=args.device,
            dtype=args.dtype,
            tune_gemm=args.tune_gemm,
            prefix_cache=args.prefix_cache,
            emulation=emulation,
        )


def process_ranks(args: argparse.Namespace) -> int:
    """The processes of one instance: its tensor degree for the real engine, 1 for an emulated
    one (which models its tp devices in one process)."""
    return 1 if args.engine == "emulated" else args.tensor_parallel_size


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options every worker's command line takes."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="memory for the KV pool, GiB (fractions allowed; per rank); default: on CUDA what "
        "--gpu-memory-utilization leaves, on CPU min(4 GiB, 25%% of available memory)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="on CUDA, the fraction of the device's memory the engine may use: weights, the "
        "activations of its largest batch, and the rest as KV (default 0.9; an emulated "
        "engine: its modelled device's, default 0.92 as the planner's)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="longest prompt + output of one request (default: the model's, capped by what "
        "one sequence can hold in the KV pool)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="prefill budget L_m (0: 2048; an emulated engine: its profile's saturation point at "
        "its tensor degree)",
    )
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
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="free a request's KV when it ends instead of keeping its full blocks for prompts "
        "that share the prefix (and reporting them to the gateway for routing)",
    )
    p.add_argument("--cpu", type=int, help="pin this process to one CPU core")
    p.add_argument(
        "--threads", type=int, help="torch threads (default: torch's choice; real engine only)"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks of one instance (tensor parallelism): this process serves and starts the "
        "others; on CUDA, rank r uses GPU r (emulated engine: the devices it models)",
    )
    g = p.add_argument_group(
        "emulated engine",
        "the forward pass replaced by its modelled time on another device; everything else "
        "is the real mesh (docs/engine.md). Never a claim about a model's output or speed.",
    )
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default="torch",
        help="torch: run the model (default); emulated: model its steps from a latency profile",
    )
    g.add_argument(
        "--profile",
        help="latency profile (`distserve profile` output or DistServe's published JSON; "
        "default: the published A100 one, scaled for models it lacks)",
    )
    g.add_argument(
        "--profile-fit",
        choices=PROFILE_FITS,
        help="a published profile's fit: distserve, or vllm (default for colocated instances, "
        "as the planner times them)",
    )
    g.add_argument(
        "--gpu-memory-gib", type=float, default=80.0, help="memory of one emulated device"
    )
    g.add_argument(
        "--link-gbs",
        type=float,
        default=300.0,
        help="bandwidth KV arrives over, GB/s (300 NVLink, 25 PCIe, 3.1 between nodes)",
    )


def configure_process(args: argparse.Namespace) -> None:
    """Pin the process to its core and set torch's thread count, as the options ask (an
    emulated engine runs no torch, and its process never imports it).

    Also shortens the interpreter's GIL switch interval (5 ms by default): the engine thread
    holds the GIL between torch kernels, and the event loop serving gRPC must get it promptly.
    """
    import sys

    sys.setswitchinterval(0.0005)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.threads and args.engine == "torch":
        import torch

        torch.set_num_threads(args.threads)
