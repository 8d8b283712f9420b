"""Llama family (Llama 2 / 3.x, SmolLM, TinyLlama, ...): the base every other family extends.

Follows Touvron et al., "LLaMA" (arXiv:2302.13971) as HF ``transformers.LlamaForCausalLM``
implements it; Llama 3.x's ``llama3`` rotary scaling and the other rotary variants are read from
``rope_scaling`` / ``rope_parameters`` (:mod:`sgrt.models.rope`). llama.cpp writes Llama's q/k
rows in interleaved rotary order; they are put back at conversion. The model code is shared
(:mod:`sgrt.models.layers`); its names are re-exported here for older imports.
"""
from __future__ import annotations

from sgrt.models.config import ModelConfig
from sgrt.models.layers import (  # noqa: F401  (re-exports)
    FUSED_PROJECTIONS,
    AttentionBackend,
    CausalAttention,
    CausalLM,
    DecoderLayer,
    LayerOps,
    NativeLayerOps,
    RMSNorm,
    apply_rotary,
)
from sgrt.models.registry import Family, base_config
from sgrt.models.rope import RotaryEmbedding  # noqa: F401

# The model class of every family; the old name stays.
LlamaForCausalLM = CausalLM


def config_from_hf(cfg: dict) -> ModelConfig:
    """Llama's HF config -> :class:`ModelConfig`.

    Raises:
        ValueError: ``attention_bias`` (Llama's also puts a bias on ``o_proj``; not implemented).
    """
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Llama (o_proj bias)")
    return base_config(cfg)


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    config_from_hf=config_from_hf,
    gguf_unpermute_qk=True,
    stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>"),
)
