"""What an engine runs on, built once at start: the real runner (this rank's share of the
weights, its attention backend, a KV pool sized for the device: services/engine/kv_sizing.py) or
the emulated one (modelled steps, no weights: services/engine/emulated.py), with the KV geometry,
device and dtype the rest of the engine and the workers read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidRequest, UnsupportedModel
from services.common.model_config import ModelConfig
from services.engine import emulated, kv_sizing
from services.engine.config import DEFAULT_MAX_BATCH_TOKENS, EngineConfig
from services.engine.emulated import PAYLOAD
from services.engine.kv_cache import KvCache, KvGeometry

if TYPE_CHECKING:
    import torch

    from services.engine.parallel import TensorParallel


@dataclass
class Built:
    """A runner and what was decided building it."""

    runner: Any  # ModelRunner or EmulatedRunner
    num_blocks: int  # the KV pool's blocks
    weights: str  # what the KV depends on (the weights' fingerprint)
    kv_geometry: KvGeometry
    kv_heads: range | list[int]  # the KV heads this rank computes and caches
    device: Any  # torch.device, or "cpu" for the emulated runner (no torch)
    dtype: Any
    tp: TensorParallel | None
    gemm_forms: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)


def build_runner(
    model_dir: Path, mc: ModelConfig, config: EngineConfig, vocab: int, tp: TensorParallel | None
) -> Built:
    """The runner `config` asks for (`config.emulation`: the emulated one)."""
    if config.emulation is None:
        return _real(model_dir, mc, config, tp)
    return _emulated(model_dir, mc, config, vocab, tp)


def more_kv_option(config: EngineConfig, device: Any) -> str:
    """The option that gives an engine's KV pool more room."""
    if config.num_blocks:
        return "num_blocks"
    if config.emulation is not None:
        return "--gpu-memory-gib or --gpu-memory-utilization"
    if config.kv_cache_bytes is None and device.type == "cuda":
        return "--gpu-memory-utilization (or give --kv-cache-gib)"
    return "--kv-cache-gib"


def _real(
    model_dir: Path, mc: ModelConfig, config: EngineConfig, tp: TensorParallel | None
) -> Built:
    """The real runner: the model's weights (this rank's share), its KV cache, attention."""
    if mc.emulated:
        raise UnsupportedModel(
            f"{model_dir} is an emulated model ({mc.emulated}: a shape, no weights); "
            "serve it with --engine emulated"
        )
    from services.engine import gemm
    from services.engine.attention import make_backend
    from services.engine.model_runner import ModelRunner
    from services.engine.parallel import TensorParallel
    from services.engine.weights import fingerprint, load_model

    tp = tp or TensorParallel()
    geometry = KvGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.kv_latent)
    kv_heads = geometry.heads_of(tp.rank, tp.world_size)
    num_heads, num_kv_heads = mc.num_heads // tp.world_size, len(kv_heads)
    device = _device(config.device)
    dtype = _dtype(config.dtype, mc.dtype, device)
    model = load_model(model_dir, mc, dtype, device, tp)
    gemm_forms: dict[tuple[int, int], dict[int, int]] = {}  # gemm.tune's plans
    if config.tune_gemm and device.type == "cpu":
        gemm_forms = gemm.tune(model, min(gemm.MAX_ROWS, config.max_num_seqs))
    backend = make_backend(
        config.attention,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=config.block_size,
        device=device,
        dtype=dtype,
        latent=mc.kv_latent,
    )

    def cache(num_blocks: int) -> KvCache:
        return KvCache(
            num_layers=mc.num_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=device,
            planes=geometry.planes,
        )

    longest = config.max_model_len or mc.max_position_embeddings

    def profile() -> None:  # the largest batches, on a pool of one block
        tokens = max(config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS, longest)
        ModelRunner(model, cache(1), backend, config.max_num_seqs).profile(tokens)

    block_bytes = KvCache.bytes_per_block(
        mc.num_layers, config.block_size, num_kv_heads, mc.head_dim, dtype, geometry.planes
    )
    # What the largest decode batch holds: max_num_seqs sequences of the longest context.
    full_batch = config.max_num_seqs * -(-longest // config.block_size) * block_bytes
    num_blocks = config.num_blocks or _agreed(
        _kv_bytes(config, device, tp, profile, full_batch) // block_bytes, device, tp
    )
    runner = ModelRunner(model, cache(max(num_blocks, 1)), backend, config.max_num_seqs)
    return Built(
        runner, num_blocks, fingerprint(model_dir), geometry, kv_heads, device, dtype, tp,
        gemm_forms,
    )  # fmt: skip


def _kv_bytes(
    config: EngineConfig,
    device: torch.device,
    tp: TensorParallel,
    profile: Callable[[], None],
    full_batch: int,
) -> int:
    """This rank's KV budget (services/engine/kv_sizing.py): `--kv-cache-gib`, else what
    `--gpu-memory-utilization` of a CUDA device leaves after `profile()`, else the CPU
    default, at most `full_batch` bytes (the largest decode batch at the longest context)."""
    utilization = config.gpu_memory_utilization
    if config.kv_cache_bytes is not None:
        if utilization is not None:
            raise InvalidRequest(
                "give --kv-cache-gib or --gpu-memory-utilization, not both: the first sizes "
                "the KV pool exactly, the second from what the device has left"
            )
        return config.kv_cache_bytes
    if device.type == "cuda":
        utilization = utilization or kv_sizing.DEFAULT_GPU_MEMORY_UTILIZATION
        return kv_sizing.measure_cuda(profile, device, utilization)
    if utilization is not None:
        raise InvalidRequest(
            "--gpu-memory-utilization sizes the KV pool of a CUDA device, and this engine "
            "runs on CPU: size it with --kv-cache-gib"
        )
    return kv_sizing.cpu_kv_bytes(kv_sizing.mem_available(), tp.world_size, full_batch)


def _agreed(num_blocks: int, device: torch.device, tp: TensorParallel) -> int:
    """The smallest of the group's ranks' pool sizes: every rank must hold the same blocks
    (each rank measured its own device or host)."""
    if tp.world_size == 1:
        return num_blocks
    import torch
    import torch.distributed as dist

    on = device if dist.get_backend(tp.group) == "nccl" else "cpu"
    n = torch.tensor([num_blocks], dtype=torch.int64, device=on)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=tp.group)
    return int(n.item())


def _emulated(
    model_dir: Path, mc: ModelConfig, config: EngineConfig, vocab: int, tp: TensorParallel | None
) -> Built:
    """The emulated runner (no weights, modelled steps), its pool's blocks."""
    if not mc.emulated:
        raise UnsupportedModel(
            f"--engine emulated serves an emulated model's folder, and {model_dir} holds "
            "a real model: `distserve model create --emulated SPEC --out DIR` makes one "
            "(SPEC: opt-13b, opt-66b, opt-175b or a model folder), and `distserve up "
            "--engine emulated --model-spec SPEC` makes it for you"
        )
    runner, num_blocks = emulated.build(model_dir, mc, config, vocab)
    return Built(
        runner,
        num_blocks,
        emulated.fingerprint(model_dir, mc),
        PAYLOAD,
        range(PAYLOAD.num_kv_heads),
        "cpu",
        emulated.PAYLOAD_DTYPE,
        tp,
    )


def _device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _dtype(choice: str, stored: str, device: torch.device) -> torch.dtype:
    """The torch dtype named `choice` (one of model_config.DTYPES), or for "auto" float32 on
    CPU and the checkpoint's `stored` dtype on a device."""
    import torch

    if choice != "auto":
        return getattr(torch, choice)
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, stored)
