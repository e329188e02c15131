"""The model families the real engine runs, one module each, sharing layers.py (nano-vllm's
`models/` is the shape). The engine, the KV pool and kvtransfer see only `CausalLM`
(base.py): which family runs is this table's business.

A new family: its config.json's reading in services/common/model_config.py (ARCHITECTURES),
its module here, its row below, and its parity test in tests/engine/test_families.py.
"""

from __future__ import annotations

from services.common.errors import UnsupportedModel
from services.common.model_config import ModelConfig
from services.engine.models.base import CausalLM
from services.engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from services.engine.models.gemma2 import Gemma2ForCausalLM
from services.engine.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from services.engine.models.mixtral import MixtralForCausalLM
from services.engine.models.opt import OPTForCausalLM
from services.engine.models.phi3 import Phi3ForCausalLM
from services.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from services.engine.parallel import TensorParallel
from services.engine.shards import check_tp

FAMILIES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
}


def build(cfg: ModelConfig, tp: TensorParallel | None = None) -> CausalLM:
    """The model of `cfg`, as rank tp.rank's share (call under torch.device("meta") to build
    without allocating, as the loader does)."""
    family = FAMILIES.get(cfg.architecture)
    if family is None:
        raise UnsupportedModel(f"{cfg.architecture} has no model code in this engine")
    tp = tp or TensorParallel()
    check_tp(cfg, tp.world_size)
    return family(cfg, tp)
