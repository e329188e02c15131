"""The model a folder describes (its Hugging Face config.json), validated once, without torch.

Shared by the engine and by services that must not load the model runtime (the gateway, the
planner). Each architecture we serve has a `Family` here: how its config.json names the shape
every service needs (layers, heads, widths, context) and which of its options we refuse. What
only the model code needs (soft-capping, expert counts, q/k norms) it reads from `raw` itself:
services/engine/models/, one file per family.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from services.common.errors import ModelLoadError, UnsupportedModel

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FULL, SLIDING = "full_attention", "sliding_attention"  # config.json's layer_types


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base `theta` and an optional scaling of its frequencies (the math:
    services/engine/rope.py)."""

    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    # yarn only: the ramp between extrapolated and interpolated frequencies (in rotations over
    # the original context), and the magnitude scales (0: unset). attention_factor multiplies
    # cos and sin (None: derived from factor, mscale and mscale_all_dim, as transformers does);
    # mscale_all_dim also scales the softmax of multi-head latent attention (DeepSeek).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True  # round the ramp's ends outward to whole dimensions


@dataclass(frozen=True)
class Biases:
    qkv: bool = False
    o: bool = False
    mlp: bool = False


@dataclass(frozen=True)
class Family:
    """How one architecture's config.json reads.

    model_type: its `model_type`; activations: the `hidden_act` values we implement (first: the
    default); biases: which linears carry a bias; intermediate: the key of the MLP width;
    tied: tie_word_embeddings when the file omits it; rotary: positions by rotary embedding
    (else learned); sliding: which layers use `sliding_window` when the file gives no
    `layer_types`; check: refusals of options we do not implement (raises UnsupportedModel);
    latent: the width of the one latent vector a token caches per layer, for multi-head latent
    attention (None: the family caches K and V heads); sparse: which layers hold a mixture of
    experts (None: a dense family).
    """

    model_type: str
    activations: tuple[str, ...] = ("silu",)
    biases: Callable[[dict], Biases] = lambda raw: Biases()
    intermediate: str = "intermediate_size"
    tied: bool = False
    rotary: bool = True
    sliding: Callable[[dict, int], bool] = lambda raw, layer: False
    check: Callable[[dict], None] = lambda raw: None
    latent: Callable[[dict], int | None] = lambda raw: None
    sparse: Callable[[dict, int], bool] | None = None


def _llama_biases(raw: dict) -> Biases:
    bias = bool(raw.get("attention_bias", False))
    return Biases(qkv=bias, o=bias, mlp=bool(raw.get("mlp_bias", False)))


def _every_layer(raw: dict, layer: int) -> bool:
    return True


def _qwen_sliding(raw: dict, layer: int) -> bool:
    return bool(raw.get("use_sliding_window")) and layer >= int(raw.get("max_window_layers", 0))


def _check_opt(raw: dict) -> None:
    hidden = raw.get("hidden_size")
    if raw.get("word_embed_proj_dim", hidden) != hidden:
        raise UnsupportedModel(
            "OPT with word_embed_proj_dim != hidden_size (opt-350m's projections) is not "
            "implemented"
        )
    if not raw.get("do_layer_norm_before", True):
        raise UnsupportedModel(
            "OPT with do_layer_norm_before false (opt-350m's post-norm layers) is not implemented"
        )
    if not raw.get("layer_norm_elementwise_affine", True):
        raise UnsupportedModel("OPT without layer_norm_elementwise_affine is not implemented")


TOPK_METHODS = ("greedy", "group_limited_greedy")  # DeepSeek-V2's routers we implement


def _deepseek_sparse(raw: dict, layer: int) -> bool:
    """Whether a DeepSeek-V2 layer holds experts: those from `first_k_dense_replace` on
    (transformers' DeepseekV2DecoderLayer's rule; the others keep a dense MLP)."""
    return layer >= int(raw.get("first_k_dense_replace", 0))


def _check_deepseek_v2(raw: dict) -> None:
    """Refuse the router options of DeepSeek's checkpoints that we do not implement, and check
    the group-limited router's sizes."""
    dense = raw.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or dense < 0:
        raise ModelLoadError(
            f"config.json: first_k_dense_replace must be an integer >= 0, got {dense!r}"
        )
    if dense >= int(raw.get("num_hidden_layers", 0)):
        return  # every layer dense: no router to read
    experts, top_k = experts_of(raw)
    scoring = raw.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise UnsupportedModel(
            f"DeepSeek-V2 with scoring_func {scoring!r} is not implemented; supported: 'softmax'"
        )
    method = raw.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise UnsupportedModel(
            f"DeepSeek-V2 with topk_method {method!r} is not implemented; supported: "
            f"{', '.join(TOPK_METHODS)}"
        )
    if raw.get("norm_topk_prob"):
        raise UnsupportedModel(
            "DeepSeek-V2 with norm_topk_prob true is not implemented (transformers ignores it, "
            "DeepSeek's own code renormalises instead of applying routed_scaling_factor); "
            "DeepSeek-V2's checkpoints set it false"
        )
    if raw.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModel(
            f"DeepSeek-V2 with moe_layer_freq {raw['moe_layer_freq']!r} is not implemented "
            "(transformers puts experts on every layer from first_k_dense_replace on); "
            "supported: 1"
        )
    if method == "group_limited_greedy":
        groups, top_groups = raw.get("n_group"), raw.get("topk_group")
        if not isinstance(groups, int) or groups < 1 or experts % groups:
            raise ModelLoadError(
                f"config.json: group_limited_greedy needs n_group, an integer >= 1 dividing "
                f"n_routed_experts ({experts}); got {groups!r}"
            )
        if not isinstance(top_groups, int) or not 1 <= top_groups <= groups:
            raise ModelLoadError(
                f"config.json: group_limited_greedy needs 1 <= topk_group <= n_group ({groups}); "
                f"got {top_groups!r}"
            )
        if top_k > top_groups * (experts // groups):
            raise ModelLoadError(
                f"config.json: num_experts_per_tok ({top_k}) exceeds the experts of topk_group "
                f"({top_groups}) groups of {experts // groups}"
            )


def _deepseek_latent(raw: dict) -> int:
    """MLA caches, per token and layer, the compressed KV (kv_lora_rank) and the shared rotary
    key (qk_rope_head_dim)."""
    return int(raw.get("kv_lora_rank", 512)) + int(raw.get("qk_rope_head_dim", 64))


def latent_attention_params(raw: Mapping) -> int:
    """Parameters of one layer of DeepSeek-V2's multi-head latent attention (the planner counts
    weights with it): q (low-rank when q_lora_rank is set), kv_a with its norm, kv_b and o."""
    h, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rank, rope = int(raw.get("kv_lora_rank", 512)), int(raw.get("qk_rope_head_dim", 64))
    nope, v = int(raw.get("qk_nope_head_dim", 128)), int(raw.get("v_head_dim", 128))
    q_rank = raw.get("q_lora_rank")
    q_out = heads * (nope + rope)
    q = h * q_out if q_rank is None else h * int(q_rank) + int(q_rank) + int(q_rank) * q_out
    kv = h * (rank + rope) + rank + rank * heads * (nope + v)
    return q + kv + heads * v * h


def _check_phi3(raw: dict) -> None:
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        raise UnsupportedModel("Phi-3 with partial_rotary_factor != 1 is not implemented")


def experts_of(raw: dict) -> tuple[int, int]:
    """(experts per MoE layer, experts each token is routed to) of a mixture-of-experts
    config.json: `num_local_experts` (Mixtral, and what transformers 5 writes), `n_routed_experts`
    (DeepSeek) or `num_experts` (Qwen3-MoE on the Hub), and `num_experts_per_tok`."""
    key = next((k for k in ("num_local_experts", "n_routed_experts") if k in raw), "num_experts")
    try:
        experts, top_k = int(raw[key]), int(raw["num_experts_per_tok"])
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json: {key} and num_experts_per_tok must be integers") from e
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"config.json: need {key} >= 1 and 1 <= num_experts_per_tok <= {key}; got "
            f"{experts} and {top_k}"
        )
    return experts, top_k


def _qwen3_moe_sparse(raw: dict, layer: int) -> bool:
    """Whether a Qwen3-MoE layer holds experts (transformers' Qwen3MoeDecoderLayer's rule): the
    others keep a dense MLP of `intermediate_size`."""
    step = int(raw.get("decoder_sparse_step", 1))
    return layer not in (raw.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def _check_mixtral(raw: dict) -> None:
    experts_of(raw)


def _check_qwen3_moe(raw: dict) -> None:
    experts_of(raw)
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ModelLoadError(
            f"config.json: decoder_sparse_step must be an integer >= 1, got {step!r}"
        )
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ModelLoadError(f"config.json: mlp_only_layers must list layer indices, got {dense!r}")


# An emulated model's folder (`distserve model create --emulated`): a shape and a tokenizer, no
# weights; only the emulated engine serves it (docs/engine.md).
EMULATED = "EmulatedForCausalLM"

# The architectures we build (services/engine/models/ holds their code).
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", biases=_llama_biases),
    "MistralForCausalLM": Family("mistral", sliding=_every_layer),
    "Qwen2ForCausalLM": Family("qwen2", biases=lambda raw: Biases(qkv=True), sliding=_qwen_sliding),
    "Qwen3ForCausalLM": Family("qwen3", biases=_llama_biases, sliding=_qwen_sliding),
    "OPTForCausalLM": Family(
        "opt",
        activations=("relu",),
        biases=lambda raw: Biases(*(3 * (bool(raw.get("enable_bias", True)),))),
        intermediate="ffn_dim",
        tied=True,
        rotary=False,
        check=_check_opt,
    ),
    "Phi3ForCausalLM": Family("phi3", sliding=_every_layer, check=_check_phi3),
    "Gemma2ForCausalLM": Family(
        "gemma2",
        activations=("gelu_pytorch_tanh",),
        biases=_llama_biases,
        tied=True,
        sliding=lambda raw, layer: layer % 2 == 0,
    ),
    "MixtralForCausalLM": Family(
        "mixtral", sliding=_every_layer, check=_check_mixtral, sparse=_every_layer
    ),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe",
        biases=_llama_biases,
        intermediate="moe_intermediate_size",
        sliding=lambda raw, layer: bool(raw.get("use_sliding_window")),
        check=_check_qwen3_moe,
        sparse=_qwen3_moe_sparse,
    ),
    "DeepseekV2ForCausalLM": Family(
        "deepseek_v2",
        biases=_llama_biases,
        intermediate="moe_intermediate_size",
        check=_check_deepseek_v2,
        latent=_deepseek_latent,
        sparse=_deepseek_sparse,
    ),
    EMULATED: Family("emulated", activations=("silu", "relu", "gelu", "gelu_pytorch_tanh")),
}

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model as described by config.json, validated once.

    rope None: positions are learned (OPT). sliding_window: the window of the layers whose
    `layer_types` entry is SLIDING (each token attends to itself and the window - 1 before it);
    no layer slides when it is None. kv_latent: the family caches one latent vector per token
    and layer (multi-head latent attention, DeepSeek-V2), shared by every query head and held
    whole by every tensor-parallel rank; num_kv_heads is then 1 and head_dim the latent's width.
    A mixture of experts: `sparse_layers` hold `num_experts` experts of intermediate_size each,
    `experts_per_token` of them run per token; the other layers' dense MLP is
    `dense_intermediate_size` wide; `shared_intermediate_size`: the width of the shared experts
    (DeepSeek-V2's n_shared_experts x the experts' width), one dense MLP every token of a
    sparse layer also runs. Without a sparse layer (DeepSeek-V2 with first_k_dense_replace >=
    num_hidden_layers) a model is dense: num_experts 0, intermediate_size the dense width.
    raw: the whole config.json, for what only the family's model code reads.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position_embeddings: int  # the longest context we serve (prompt + output)
    rope: RopeConfig | None = field(default_factory=RopeConfig)
    biases: Biases = field(default_factory=Biases)
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # the dtype the weights are stored in
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    emulated: str | None = None  # an emulated model's spec (e.g. opt-13b); None: real weights
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; (): every layer FULL
    kv_latent: bool = False
    num_experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    sparse_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    raw: Mapping = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model folder {path} does not exist")
        file = path / "config.json"
        if not file.exists():
            raise ModelLoadError(
                f"{file} is missing: a model folder needs a Hugging Face config.json"
            )
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
        generation = path / "generation_config.json"
        if generation.exists():
            try:
                gen = json.loads(generation.read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{generation} is not valid JSON: {e}") from e
            for key in ("eos_token_id", "bos_token_id"):
                if gen.get(key) is not None:
                    raw = {**raw, key: gen[key]}
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        _refuse_quantized(raw)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(a for a in ARCHITECTURES if a != EMULATED)}"
            )
        family = ARCHITECTURES[arch]
        act = (
            raw.get("hidden_activation")
            or raw.get("hidden_act")
            or raw.get("activation_function")
            or family.activations[0]
        )
        if act == "swish":
            act = "silu"
        if act not in family.activations:
            raise UnsupportedModel(
                f"unsupported hidden_act {act!r} for {arch}; supported: "
                f"{', '.join(family.activations)}"
            )
        family.check(raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            window = raw.get("sliding_window")
            window = int(window) if window else None
            latent = family.latent(raw)
            sparse = tuple(i for i in range(layers) if family.sparse and family.sparse(raw, i))
            experts, top_k = experts_of(raw) if sparse else (0, 0)
            # A mixture of experts' width is its experts'; without sparse layers, the dense one.
            width = family.intermediate if sparse or not family.sparse else "intermediate_size"
            shared = int(raw.get("n_shared_experts") or 0) * int(raw[width]) if sparse else 0
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw[width]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=1 if latent else int(raw.get("num_key_value_heads") or heads),
                head_dim=latent or int(raw.get("head_dim") or hidden // heads),
                norm_eps=float(raw.get("rms_norm_eps", raw.get("layer_norm_eps", 1e-5))),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rope=_rope(raw) if family.rotary else None,
                biases=family.biases(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.tied)),
                dtype=_dtype(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_ids(raw.get("eos_token_id")),
                emulated=str(raw["distserve_emulated"]) if arch == EMULATED else None,
                hidden_act=act,
                sliding_window=window,
                layer_types=_layer_types(raw, family, layers, window),
                kv_latent=latent is not None,
                num_experts=experts,
                experts_per_token=top_k,
                sparse_layers=sparse,
                dense_intermediate_size=int(raw.get("intermediate_size") or 0),
                shared_intermediate_size=shared,
                raw=MappingProxyType(dict(raw)),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a field of the wrong type: {e}") from e
        cfg._check()
        return cfg

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def _check(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config.json: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """What one token's KV takes, all layers (all ranks: a latent is not split)."""
        planes = 1 if self.kv_latent else 2  # one latent, or K and V
        return planes * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _refuse_quantized(raw: dict) -> None:
    """A quantised checkpoint (GPTQ, AWQ, bitsandbytes, FP8 ...) stores packed integers and
    scales our layers do not read: refuse it by name rather than fail on a tensor's dtype."""
    quant = raw.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else "unnamed"
    raise UnsupportedModel(
        f"config.json has a quantization_config (quant_method {method!r}): quantised "
        "checkpoints are not supported; serve the unquantised weights (float32, bfloat16 or "
        "float16)"
    )


def _rope(raw: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return RopeConfig(theta=theta)
    # The pretraining context: a top-level original_max_position_embeddings first (Phi-3 keeps
    # it there), then the scaling's own, else the model's context (transformers' order).
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", raw.get("max_position_embeddings", 2048)
    )
    factor = params.get("factor")
    if factor is None and kind == "yarn":  # yarn may leave it to the two contexts' ratio
        factor = int(raw.get("max_position_embeddings", 2048)) / int(original)
    factor = float(1.0 if factor is None else factor)
    if factor < 1.0:
        raise UnsupportedModel(f"rope scaling factor must be >= 1, got {factor}")
    if kind == "linear":
        return RopeConfig(theta=theta, type=kind, factor=factor)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            type=kind,
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        type=kind,
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _layer_types(raw: dict, family: Family, layers: int, window: int | None) -> tuple[str, ...]:
    """Which layers slide: config.json's `layer_types` (transformers >= 4.54 writes it), else
    the family's rule; () when none does (no window: none can)."""
    if window is None:
        return ()
    given = raw.get("layer_types")
    if given is not None:
        types = tuple(given)
        if len(types) != layers or not set(types) <= {FULL, SLIDING}:
            raise ModelLoadError(
                f"config.json: layer_types must list {layers} entries, each {FULL!r} or {SLIDING!r}"
            )
    else:
        types = tuple(SLIDING if family.sliding(raw, i) else FULL for i in range(layers))
    return types if SLIDING in types else ()


def _dtype(raw: dict) -> str:
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if name not in DTYPES:
        raise UnsupportedModel(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return name


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
