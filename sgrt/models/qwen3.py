"""Qwen3 family (dense): Llama with an RMSNorm over each head of q and k before rotary.

As HF ``Qwen3ForCausalLM`` implements it (Qwen team, arXiv:2505.09388): ``q_norm`` / ``k_norm``
of ``head_dim`` weights, no QKV bias, ``head_dim`` usually not ``hidden / heads``. Its GGUF is
``qwen3`` with ``attn_q_norm`` / ``attn_k_norm`` tensors.
"""
from __future__ import annotations

from sgrt.models.config import ModelConfig
from sgrt.models.qwen2 import gguf_extras, with_window_layers
from sgrt.models.registry import Family, base_config


def config_from_hf(cfg: dict) -> ModelConfig:
    """Qwen3's HF config -> :class:`ModelConfig`.

    Raises:
        ValueError: ``attention_bias`` (not implemented with an ``o_proj`` bias).
    """
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Qwen3")
    return with_window_layers(base_config(cfg, qk_norm=True), cfg)


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    config_from_hf=config_from_hf,
    gguf_extras=gguf_extras,
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
)
