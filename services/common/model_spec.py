"""The shape of a model as the planner and the emulated engine see it, and what fits on a device.

Both need only what decides memory and parallelism: weight bytes, KV bytes per token, how many
heads (tensor parallelism splits them) and layers (pipeline parallelism splits them). Presets
name the OPT models DistServe evaluates; any other model is read from a Hugging Face folder's
config.json (our `tiny` and `small` presets are such folders).

KV capacity of an instance (tokens it can hold, `kv_capacity`) comes from DistServe's published
table for the A100-80GB (`max_num_tokens.csv`) when the model and (tp, pp) are listed there, else
it is computed: `(tp * pp * gpu_memory * utilization - weight_bytes) / kv_bytes_per_token`. The
default utilization 0.92 reproduces the published table within a few per cent (tests check it).
The planner's simulator and the emulated engine size their KV pools with the same function.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidRequest

DATA = Path(__file__).parent / "data" / "distserve-a100"
GIB = 2**30
PUBLISHED_GPU_MEMORY = 80 * GIB  # the A100-80GB of DistServe's table
MEMORY_UTILIZATION = 0.92


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer; `published` is its name in DistServe's data files, if any."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_context: int  # longest prompt + output the model serves
    dtype_bytes: int = 2
    mlp_matrices: int = 2  # OPT: fc1, fc2; Llama: gate, up, down
    learned_positions: bool = False  # OPT learns a position table (max_context x hidden)
    published: str | None = None
    # A mixture of experts: `sparse_layers` of the layers hold `num_experts` experts of
    # `expert_intermediate_size`, `experts_per_token` of them run per token (the rest of the
    # layers: a dense MLP of intermediate_size).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sparse_layers: int = 0
    # DeepSeek-V2's shared experts: a dense MLP of this width that every token of a sparse
    # layer runs beside its routed experts (stored and active).
    shared_intermediate_size: int = 0
    # One layer's attention parameters where the heads do not give them (multi-head latent
    # attention's low-rank projections); 0: from the heads.
    attention_params: int = 0
    # What a token caches per layer: kv_planes (2: K and V; 1: a latent, multi-head latent
    # attention) of num_kv_heads x kv_head_dim (0: head_dim).
    kv_planes: int = 2
    kv_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def _params(self, experts: int) -> int:
        h = self.hidden_size
        d = self.head_dim if self.kv_planes == 1 else (self.kv_head_dim or self.head_dim)
        attention = self.attention_params or h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        dense = self.mlp_matrices * h * self.intermediate_size
        width = experts * self.expert_intermediate_size + self.shared_intermediate_size
        sparse = self.mlp_matrices * h * width
        sparse += h * self.num_experts  # the router
        mlps = (self.num_layers - self.sparse_layers) * dense + self.sparse_layers * sparse
        embeddings = 2 * self.vocab_size * h  # input table and LM head
        positions = self.max_context * h if self.learned_positions else 0
        return self.num_layers * attention + mlps + embeddings + positions

    @property
    def num_params(self) -> int:
        """Parameters stored (every expert): what the weights take in memory."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (its experts only): what its FLOPs scale with."""
        return self._params(self.experts_per_token)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token leaves in the cache, over all layers."""
        width = self.num_kv_heads * (self.kv_head_dim or self.head_dim)
        return self.kv_planes * self.num_layers * width * self.dtype_bytes

    def attention_flops_per_token2(self) -> int:
        """FLOPs of attention scores and values per (query, key) pair, summed over layers."""
        return 4 * self.num_layers * self.hidden_size


def _opt(name: str, layers: int, heads: int, hidden: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        vocab_size=50272,
        max_context=2048,
        learned_positions=True,
        published=f"facebook/{name}",
    )


# The OPT family as published (Zhang et al. 2022, table 1), in fp16.
PRESETS: dict[str, ModelSpec] = {
    "opt-13b": _opt("opt-13b", 40, 40, 5120),
    "opt-66b": _opt("opt-66b", 64, 72, 9216),
    "opt-175b": _opt("opt-175b", 96, 96, 12288),
}


def model_spec(name_or_dir: str | Path) -> ModelSpec:
    """A preset by name (opt-13b, opt-66b, opt-175b), or the model of a Hugging Face folder."""
    key = str(name_or_dir).lower().removeprefix("facebook/")
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_dir)
    try:
        is_dir = path.is_dir()
    except OSError:  # e.g. a name too long for a path: no folder either
        is_dir = False
    if not is_dir:
        raise InvalidRequest(
            f"unknown model {name_or_dir!r}: give one of {', '.join(PRESETS)} or a model folder "
            "with a config.json",
            param="model_spec",
        )
    return from_dir(path)


def from_dir(path: Path) -> ModelSpec:
    """The spec of a Hugging Face folder our engine serves, in its stored dtype. An OPT folder
    of a published model's shape is that model (`published`: the planner then times it with the
    published profile, as `--model-spec opt-13b` does)."""
    from services.common.model_config import ModelConfig, latent_attention_params

    mc = ModelConfig.from_dir(path)
    opt = mc.architecture == "OPTForCausalLM"
    spec = ModelSpec(
        name=path.name,
        num_layers=mc.num_layers,
        num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        vocab_size=mc.vocab_size,
        max_context=mc.max_position_embeddings,
        dtype_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[mc.dtype],
        mlp_matrices=2 if opt else 3,
        learned_positions=opt,
        num_experts=mc.num_experts,
        experts_per_token=mc.experts_per_token,
        expert_intermediate_size=mc.intermediate_size if mc.num_experts else 0,
        sparse_layers=len(mc.sparse_layers),
        shared_intermediate_size=mc.shared_intermediate_size,
        attention_params=latent_attention_params(mc.raw) if mc.kv_latent else 0,
        kv_planes=1 if mc.kv_latent else 2,
        kv_head_dim=0 if mc.head_dim == mc.hidden_size // mc.num_heads else mc.head_dim,
    )
    if mc.num_experts:
        spec = dataclasses.replace(spec, intermediate_size=mc.dense_intermediate_size)
    for preset in PRESETS.values():
        if dataclasses.replace(spec, name=preset.name, published=preset.published) == preset:
            return dataclasses.replace(spec, published=preset.published)
    return spec


@functools.cache
def published_kv_capacity() -> dict[tuple[str, int, int], int]:
    """DistServe's KV capacity in tokens per (model, tp, pp) on A100-80GB."""
    with (DATA / "max_num_tokens.csv").open() as f:
        return {
            (row["model"], int(row["tp"]), int(row["pp"])): int(row["max_num_tokens"])
            for row in csv.DictReader(f)
        }


def computed_kv_capacity(
    model: ModelSpec,
    tp: int,
    pp: int,
    gpu_memory_bytes: int = PUBLISHED_GPU_MEMORY,
    utilization: float = MEMORY_UTILIZATION,
) -> int:
    usable = tp * pp * gpu_memory_bytes * utilization
    return max(0, int((usable - model.weight_bytes) // model.kv_bytes_per_token))


def kv_capacity(
    model: ModelSpec,
    tp: int,
    pp: int,
    gpu_memory_bytes: int = PUBLISHED_GPU_MEMORY,
    utilization: float = MEMORY_UTILIZATION,
) -> int:
    """Tokens of KV one instance of (tp, pp) holds once its weights are loaded (0: none fit)."""
    if gpu_memory_bytes == PUBLISHED_GPU_MEMORY and model.published:
        table = published_kv_capacity()
        if (model.published, tp, pp) in table:
            return table[(model.published, tp, pp)]
    return computed_kv_capacity(model, tp, pp, gpu_memory_bytes, utilization)
