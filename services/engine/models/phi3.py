"""Phi-3: a Llama-shaped decoder whose checkpoint stores q/k/v as one `qkv_proj` and gate/up as
one `gate_up_proj` (split per part between tensor-parallel ranks as they load)."""

from __future__ import annotations

from services.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_packed_from = None
    mlp_packed_from = None
