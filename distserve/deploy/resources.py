"""CPU, memory and GPU requests of each pod, derived from the plan's model and each pool's shape.

A worker pod is one instance: `tp` ranks (processes) of one engine. What it needs:

- GPUs: `nvidia.com/gpu: tp`. Its GPUs hold the weights, the KV pool and the activations; the
  pool is sized on the device at start (kv_sizing.py), so the renderer only refuses a pool whose
  weights alone overflow its GPUs (`--gpu-memory-gib`, the planner's A100-80GB by default).
- host memory on a GPU pod: per rank a process (Python, torch, gRPC, UCX: PROCESS_BYTES) and the
  host side of CUDA (context, cuBLAS/NCCL: CUDA_HOST_BYTES); the weights load through a buffer
  of their largest tensor (services/engine/weights.py), and /dev/shm (SHM_BYTES, the volume's
  size limit, which memory-backed volumes charge to the pod).
- host memory on a CPU pod (`--device cpu`): the same plus what the GPUs would hold: the weights
  in the compute dtype (float32 unless `--dtype` says otherwise), the KV pool, and the
  activations of the largest prefill batch (`max_batch_tokens` tokens: the residual stream on
  every rank, the MLP's intermediate split across them) and of the largest decode batch's logits.
  The KV pool is rendered into the worker's arguments (`--kv-cache-gib`), unless given: the
  engine's CPU default reads the node's free memory, not the pod's, so the pod states it: the
  smaller of 4 GiB and what `max_num_seqs` sequences of `max_model_len` tokens hold.

The sum times MARGIN (allocator fragmentation, the page cache of the files read), rounded up to
256 MiB, is both the request and the limit: a pod gets what it was sized for or is not placed,
and a worker pod, whose CPU request is a whole number of cores, gets the Guaranteed QoS class
(exclusive cores under the kubelet's static CPU manager).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from distserve.deploy.objects import GPU
from distserve.deploy.pools import WorkerPool
from services.common.errors import InvalidRequest
from services.common.model_spec import ModelSpec
from services.engine.config import DEFAULT_MAX_BATCH_TOKENS
from services.engine.kv_sizing import CPU_KV_MAX_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION

GIB, MIB = 2**30, 2**20
PROCESS_BYTES = 1 * GIB  # one rank's process before its model: Python, torch, gRPC, UCX
CUDA_HOST_BYTES = 2 * GIB  # the host side of one rank's CUDA context and libraries
SHM_BYTES = 1 * GIB  # /dev/shm of a worker pod: UCX's shared-memory transport, ranks' IPC
MARGIN = 1.2
ROUND = 256 * MIB
DEVICES = ("cuda", "cpu")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The pods that run no model: fixed sizes (their work does not grow with the model).
GATEWAY = (2, 2 * GIB)  # cores, bytes: one asyncio process and its tokenizer's threads
PLANNER = (1, 1 * GIB)  # the goodput search and simulator, off the request path
ETCD = (1, 1 * GIB)  # one etcd member: the mesh's few keys, its watches and leases
ENVOY = (1, 512 * MIB)  # one Envoy worker thread (EdgeConfig.concurrency)
STEP = (1, 1 * GIB)  # an init container: a download, or writing Envoy's configuration


@dataclass(frozen=True)
class Footprint:
    """One worker pod's requests (= limits), and the parts its memory was summed from."""

    cpus: int
    memory_bytes: int
    gpus: int
    parts: dict[str, int]  # bytes of each part, before the margin
    kv_cache_bytes: int | None = None  # CPU pods: the KV pool to render into the arguments

    def resources(self) -> dict:
        amounts: dict = {"cpu": str(self.cpus), "memory": quantity(self.memory_bytes)}
        if self.gpus:
            amounts[GPU] = self.gpus
        return {"requests": dict(amounts), "limits": dict(amounts)}


def fixed(size: tuple[int, int]) -> dict:
    """Requests = limits of a pod that runs no model."""
    amounts = {"cpu": str(size[0]), "memory": quantity(size[1])}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def quantity(n: int) -> str:
    return f"{n // GIB}Gi" if n % GIB == 0 else f"{math.ceil(n / MIB)}Mi"


def worker_footprint(
    spec: ModelSpec,
    pool: WorkerPool,
    engine: argparse.Namespace,
    *,
    device: str,
    gpu_memory_gib: float,
    cpus_per_rank: int,
) -> Footprint:
    """The pod of one instance of `pool` (module docstring). `engine`: the pool's worker options
    as its own parser reads them (kv_cache_gib, max_num_seqs, max_model_len, max_batch_tokens,
    dtype, gpu_memory_utilization)."""
    if device not in DEVICES:
        raise InvalidRequest(f"device must be one of {DEVICES}, not {device!r}")
    tp = pool.tp * pool.pp
    process = tp * PROCESS_BYTES
    if device == "cuda":
        utilization = engine.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        usable = tp * gpu_memory_gib * GIB * utilization
        if spec.weight_bytes >= usable:
            raise InvalidRequest(
                f"the {pool.role} instances (tp={pool.tp}) cannot hold {spec.name}: its weights "
                f"take {spec.weight_bytes / GIB:.1f} GiB, {tp} GPUs of {gpu_memory_gib:g} GiB at "
                f"utilization {utilization:g} give {usable / GIB:.1f} GiB (plan for larger tp, "
                "or give the GPUs' --gpu-memory-gib)"
            )
        parts = {
            "processes": process,
            "cuda_host": tp * CUDA_HOST_BYTES,
            "load_buffer": _largest_tensor(spec) * spec.dtype_bytes,
            "shm": SHM_BYTES,
        }
        return Footprint(tp * cpus_per_rank, _sized(parts), tp, parts)
    compute = 4 if engine.dtype == "auto" else _DTYPE_BYTES[engine.dtype]
    kv_per_token = spec.kv_bytes_per_token // spec.dtype_bytes * compute
    max_len = engine.max_model_len or spec.max_context
    if engine.kv_cache_gib is not None:
        kv = int(engine.kv_cache_gib * GIB)
    else:
        kv = min(CPU_KV_MAX_BYTES, engine.max_num_seqs * max_len * kv_per_token)
        kv = math.ceil(kv / MIB) * MIB
    batch = engine.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    residual = tp * batch * 4 * spec.hidden_size  # hidden states, norms, attention output
    mlp = batch * spec.mlp_matrices * spec.intermediate_size  # split across the ranks
    logits = tp * engine.max_num_seqs * spec.vocab_size * 4  # float32, gathered on each rank
    parts = {
        "weights": spec.num_params * compute,
        "kv_pool": kv,
        "activations": (residual + mlp) * compute + logits,
        "processes": process,
        "shm": SHM_BYTES,
    }
    explicit = None if engine.kv_cache_gib is not None else kv
    return Footprint(tp * cpus_per_rank, _sized(parts), 0, parts, explicit)


def _largest_tensor(spec: ModelSpec) -> int:
    """Elements of the largest weight tensor: an embedding or LM head, or one MLP matrix."""
    h = spec.hidden_size
    widest = max(spec.intermediate_size, spec.expert_intermediate_size)
    return max(spec.vocab_size * h, widest * h, spec.max_context * h)


def _sized(parts: dict[str, int]) -> int:
    return math.ceil(sum(parts.values()) * MARGIN / ROUND) * ROUND
