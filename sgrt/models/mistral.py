"""Mistral family (Mistral 7B, Ministral, ...): Llama with a sliding window on every layer.

Jiang et al., "Mistral 7B" (arXiv:2310.06825), as HF ``MistralForCausalLM`` implements it: every
layer attends to the ``sliding_window`` latest tokens (itself included); ``sliding_window: null``
makes it plain Llama. llama.cpp writes Mistral GGUFs with ``general.architecture = llama``, which
the Llama family reads.
"""
from __future__ import annotations

from sgrt.models.config import ModelConfig
from sgrt.models.registry import Family, base_config


def config_from_hf(cfg: dict) -> ModelConfig:
    """Mistral's HF config -> :class:`ModelConfig` (all layers windowed unless ``layer_types``)."""
    return base_config(cfg, attention_bias=False)


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    hf_model_types=("mistral",),
    gguf_architectures=(),
    config_from_hf=config_from_hf,
    stop_tokens=("</s>",),
)
