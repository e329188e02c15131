"""Decode speed of every dense model family beside transformers (no target: where a family is slow).

For each dense family the engine serves (OPT, Mistral (Llama's layers), Qwen3, Phi-3, Gemma 2,
DeepSeek-V2's latent attention), a random checkpoint of about 100M parameters that transformers
writes (tests/engine/families.py, grown to the `small` preset's shape: hidden 768, 12 layers,
12 heads), float32 on CPU, on the real engine. Decode tokens/s at batch 32 with prompts uniform
in [64, 512] and 32 new tokens each, from the median step: ours (paged KV, continuous batching)
and transformers `generate` on the same left-padded batch, in the same run. Prints a table and
one JSON line (`decode_tok_s_b32` per family: ours, transformers, ratio).

Run: `.venv/bin/python bench/engine/families.py` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine.timing import hf_decode, ours_decode, random_prompt
from distserve.loadgen.report import cpu_model, log
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from tests.engine.families import write_family

SMALL = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=2048
)
GATED = dict(intermediate_size=3072, num_key_value_heads=4)
# Each family at about the `small` preset's size: its own names for the same shape.
SIZES: dict[str, dict] = {
    "opt": {**SMALL, "ffn_dim": 3072, "word_embed_proj_dim": 768},
    "mistral-window": {**SMALL, **GATED, "sliding_window": 4096},
    "qwen3": {**SMALL, **GATED, "head_dim": 64},
    "phi3": {**SMALL, **GATED},
    "gemma2": {
        **SMALL,
        **GATED,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "deepseek-v2": {
        **SMALL,
        "intermediate_size": 3072,
        "first_k_dense_replace": 12,
        "q_lora_rank": 384,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
    },
}


def measure(name: str, folder: Path, batch: int, new: int, gen: torch.Generator) -> dict:
    import transformers

    engine = LLMEngine(folder, EngineConfig(kv_cache_bytes=2 * 2**30, max_num_seqs=64))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters())
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(int(n), gen, vocab) for n in torch.randint(64, 513, (batch,))]
    ours = batch / statistics.median(ours_decode(engine, prompts, new))
    ref = batch / statistics.median(hf_decode(hf, prompts, new))
    log(f"{name}: {params / 1e6:.0f}M params; ours {ours:.1f} tok/s, transformers {ref:.1f}")
    return {
        "params_m": round(params / 1e6, 1),
        "ours": round(ours, 1),
        "transformers": round(ref, 1),
        "ratio": round(ours / ref, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(SIZES), help="comma-separated names")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    import transformers

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            folder = write_family(name, Path(tmp) / name, **SIZES[name])
            results[name] = measure(name, folder, args.batch, args.new_tokens, gen)
    print(
        f"\ndecode at batch {args.batch}, prompts 64-512, {args.new_tokens} new tokens, float32, "
        f"real engine, {cpu_model()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}"
    )
    print(f"{'family':<16}{'params':>9}{'ours tok/s':>12}{'transformers':>14}{'ratio':>8}")
    for name, r in results.items():
        print(
            f"{name:<16}{r['params_m']:>8.0f}M{r['ours']:>12.1f}{r['transformers']:>14.1f}"
            f"{r['ratio']:>8.2f}"
        )
    print(
        json.dumps(
            {
                "bench": "engine_families",
                "engine": "torch",
                "cpu": cpu_model(),
                "batch": args.batch,
                "decode_tok_s_b32": results,
            }
        )
    )


if __name__ == "__main__":
    main()
