"""Embedded models: real Llama-family architectures with random weights from a fixed seed.

`tiny` keeps CPU tests fast; `small` (about 100M parameters) keeps each phase's character in
benchmarks: prefill compute-bound, decode memory-bound. Both use a byte-level BPE tokenizer trained
here, deterministically, on a short embedded text.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import InvalidRequest
from services.common.model_config import EMULATED
from services.common.model_spec import ModelSpec

if TYPE_CHECKING:
    import torch

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 1
TOKENIZER_VOCAB = 1024
PRESET_VERSION = 2  # bump when a preset's files change, so cached copies are made anew
# The embedded models' chat template: ChatML (as Qwen2 ships it) after BOS. <|im_end|> ends the
# assistant's turn, so generation_config.json lists it beside <|end_of_text|> as an EOS id.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
END_OF_TURN_ID = 3  # <|im_end|>

PRESETS: dict[str, dict] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
    "small": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
    },
}

_ARCH_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


def build_tokenizer():
    """A byte-level BPE tokenizer trained on the embedded corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (Path(__file__).parent / "data" / "corpus.txt").read_text()
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[BOS_ID]} $A",
        pair=f"{SPECIAL_TOKENS[BOS_ID]} $A $B",
        special_tokens=[(SPECIAL_TOKENS[BOS_ID], BOS_ID)],
    )
    return tok


def model_config(
    preset: str,
    *,
    architecture: str = "LlamaForCausalLM",
    vocab_size: int,
    dtype: str = "float32",
    **overrides: object,
) -> dict:
    """config.json of a preset, with overrides (rope_scaling, tie_word_embeddings...)."""
    if preset not in PRESETS:
        raise InvalidRequest(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if architecture not in _ARCH_MODEL_TYPE:
        raise InvalidRequest(f"unknown architecture {architecture!r}")
    cfg = {
        "architectures": [architecture],
        "model_type": _ARCH_MODEL_TYPE[architecture],
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": dtype,
        **PRESETS[preset],
        **overrides,
    }
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors, each normal(0, 1/sqrt(fan_in)) so logits are well spread;
    norm scales near 1, biases small. (torch is imported here: making an emulated model's
    folder, or reading a preset, needs none.)"""
    import torch

    from services.common.model_config import ModelConfig
    from services.engine.weights import checkpoint_shapes

    mc = ModelConfig.from_dict(cfg)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(mc).items():
        if "embed" in name:
            t = torch.randn(shape, generator=gen)
        elif "norm" in name.rsplit(".", 2)[-2]:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        out[name] = t.to(getattr(torch, mc.dtype)).contiguous()
    return out


def create_model(
    preset: str,
    out: str | Path,
    *,
    seed: int = 0,
    architecture: str = "LlamaForCausalLM",
    dtype: str = "float32",
    shards: int = 1,
    **overrides: object,
) -> Path:
    """Write a Hugging Face-format model folder for `preset`; returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = model_config(
        preset, architecture=architecture, vocab_size=tok.get_vocab_size(), dtype=dtype, **overrides
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_OF_TURN_ID]}, indent=2)
        + "\n"
    )
    _write_tokenizer_config(out, cfg["max_position_embeddings"])
    from safetensors.torch import save_file

    tensors = random_weights(cfg, seed)
    if shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        _save_sharded(tensors, out, shards)
    return out


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def create_emulated(spec: ModelSpec, out: str | Path) -> Path:
    """Write an emulated model's folder for `spec`: its shape in config.json (architecture
    `EmulatedForCausalLM`, the whole spec under `distserve_model_spec`) and the presets' byte-level
    tokenizer; no weights. Only the emulated engine serves it (docs/engine.md)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = {
        "architectures": [EMULATED],
        "model_type": "emulated",
        "distserve_emulated": spec.name,
        "distserve_model_spec": asdict(spec),
        "vocab_size": max(spec.vocab_size, tok.get_vocab_size()),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_context,
        "torch_dtype": {4: "float32"}.get(spec.dtype_bytes, "float16"),
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _write_tokenizer_config(out, spec.max_context)
    return out


def _write_tokenizer_config(out: Path, max_length: int) -> None:
    """tokenizer_config.json as transformers writes it: the special tokens and the chat
    template, so the embedded models chat as a Hub model does."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def emulated_model(spec: ModelSpec) -> Path:
    """The emulated folder of `spec`, made on first use in the cache directory; its name (the
    served model's, by default) is `<spec>-emulated`."""
    key = json.dumps([PRESET_VERSION, asdict(spec)], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    path = cache_dir() / "emulated" / digest / f"{spec.name}-emulated"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=path.parent))
    try:
        create_emulated(spec, tmp)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def cache_dir() -> Path:
    """Where embedded models are generated: $DISTSERVE_CACHE, else ~/.cache/distserve."""
    root = os.environ.get("DISTSERVE_CACHE") or Path.home() / ".cache" / "distserve"
    return Path(root)


def default_model(preset: str = "tiny") -> Path:
    """The embedded `preset`, generated on first use into the cache directory."""
    if preset not in PRESETS:
        raise InvalidRequest(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    key = json.dumps([PRESET_VERSION, PRESETS[preset]], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    path = cache_dir() / "models" / f"{preset}-{digest}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary folder and rename, so a concurrent or interrupted creation never
    # leaves a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=path.parent))
    try:
        create_model(preset, tmp)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
