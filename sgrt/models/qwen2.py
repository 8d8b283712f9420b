"""Qwen2 / Qwen2.5 family: Llama with biases on the q, k and v projections.

As HF ``Qwen2ForCausalLM`` implements it (Qwen team, arXiv:2407.10671). ``use_sliding_window``
with ``max_window_layers`` windows the layers from that index on (older configs; newer ones
spell it ``layer_types``). Its GGUF is ``qwen2`` with ``attn_{q,k,v}.bias`` tensors.
"""
from __future__ import annotations

from sgrt.models.config import ModelConfig
from sgrt.models.registry import Family, base_config


def config_from_hf(cfg: dict) -> ModelConfig:
    """Qwen2's HF config -> :class:`ModelConfig` (QKV bias always on)."""
    return with_window_layers(base_config(cfg, attention_bias=True), cfg)


def with_window_layers(config: ModelConfig, cfg: dict) -> ModelConfig:
    """Qwen's older spelling of windows (also Qwen3's): with a ``sliding_window`` and no
    ``layer_types``, the layers from ``max_window_layers`` on are windowed."""
    if config.sliding_window is not None and config.layer_types is None:
        first = int(cfg.get("max_window_layers", 0))
        config.layer_types = ["sliding_attention" if i >= first else "full_attention"
                              for i in range(config.num_hidden_layers)]
    return config


def gguf_extras(hf: dict, meta, tensors: dict) -> None:
    """A Qwen GGUF records no window use: its models run with full attention."""
    hf["use_sliding_window"] = False


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    config_from_hf=config_from_hf,
    gguf_extras=gguf_extras,
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
)
