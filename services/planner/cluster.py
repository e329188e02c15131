"""The cluster a placement is for, and what fits in its memory.

A cluster is `nodes` x `gpus_per_node` identical devices. Tensor parallelism stays inside a node
(it all-reduces every layer); pipeline stages may span nodes. KV moves over NVLink-class links
inside a node and over the network between nodes; both bandwidths are in bytes per second.
An instance's KV capacity is `services.common.model_spec.kv_capacity` on the cluster's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common import model_spec
from services.common.errors import InvalidRequest
from services.common.model_spec import GIB, MEMORY_UTILIZATION, ModelSpec


@dataclass(frozen=True)
class ClusterSpec:
    """nodes x gpus_per_node devices; bandwidths in bytes/s (defaults: A100 NVLink, 25 Gb/s)."""

    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int = 80 * GIB
    intra_node_bandwidth: float = 300e9
    inter_node_bandwidth: float = 25e9 / 8
    memory_utilization: float = MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise InvalidRequest("a cluster needs at least one node of at least one GPU")
        if self.intra_node_bandwidth <= 0 or self.inter_node_bandwidth <= 0:
            raise InvalidRequest("link bandwidths must be positive")
        if not 0 < self.memory_utilization <= 1:
            raise InvalidRequest("memory_utilization must be in (0, 1]")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """`NODESxGPUS[,INTRA_GBS,INTER_GBS]`, bandwidths in GB/s: e.g. `4x8` or `4x8,300,3.1`."""
        parts = text.split(",")
        try:
            nodes, gpus = (int(x) for x in parts[0].lower().split("x"))
            bws = [float(x) * 1e9 for x in parts[1:]]
        except ValueError:
            raise InvalidRequest(
                f"cluster {text!r}: expected NODESxGPUS[,INTRA_GBS,INTER_GBS], e.g. 4x8,300,3.1",
                param="cluster",
            ) from None
        if len(bws) not in (0, 2):
            raise InvalidRequest("cluster: give both bandwidths (intra, inter) or neither")
        extra = {"intra_node_bandwidth": bws[0], "inter_node_bandwidth": bws[1]} if bws else {}
        return cls(nodes=nodes, gpus_per_node=gpus, **extra)


def kv_capacity(model: ModelSpec, tp: int, pp: int, cluster: ClusterSpec) -> int:
    """Tokens of KV one instance of (tp, pp) holds on this cluster's GPUs (0: none fit)."""
    return model_spec.kv_capacity(
        model, tp, pp, cluster.gpu_memory_bytes, cluster.memory_utilization
    )


def parallel_problem(
    model: ModelSpec, tp: int, pp: int, cluster: ClusterSpec, min_tokens: int
) -> str | None:
    """Why (tp, pp) cannot host the model on this cluster, or None when it can.

    min_tokens: the longest request (prompt + output) that must fit in the KV cache.
    """
    if tp < 1 or pp < 1:
        return f"tp={tp}, pp={pp}: degrees must be at least 1"
    if model.num_heads % tp:
        return f"tp={tp} does not divide the {model.num_heads} attention heads"
    if model.num_layers % pp:
        return f"pp={pp} does not divide the {model.num_layers} layers"
    if tp > cluster.gpus_per_node:
        return f"tp={tp} exceeds the {cluster.gpus_per_node} GPUs of a node"
    if tp * pp > cluster.num_gpus:
        return f"tp*pp={tp * pp} exceeds the cluster's {cluster.num_gpus} GPUs"
    capacity = kv_capacity(model, tp, pp, cluster)
    if capacity < min_tokens:
        per_gpu = model.weight_bytes / (tp * pp) / GIB
        return (
            f"tp={tp}, pp={pp}: {per_gpu:.1f} GiB of weights per GPU leaves KV room for "
            f"{capacity} tokens, fewer than the longest request ({min_tokens})"
        )
    return None


def divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
