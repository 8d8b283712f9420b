"""Phi-3 / Phi-3.5 / Phi-4-mini family: Llama with fused projections and long-rope scaling.

As HF ``Phi3ForCausalLM`` implements it (Abdin et al., arXiv:2404.14219): the checkpoint holds
``self_attn.qkv_proj`` (q, k, v rows stacked) and ``mlp.gate_up_proj`` (gate then up), split
here into the canonical names; ``rope_scaling`` ``longrope`` (``short_factor`` / ``long_factor``,
:mod:`sgrt.models.rope`); ``partial_rotary_factor`` (Phi-4-mini: 0.75); an optional
``sliding_window`` on every layer. Its GGUF is ``phi3`` (``attn_qkv``, ``ffn_up`` = gate and up,
``rope_factors_long`` / ``rope_factors_short``).
"""
from __future__ import annotations

from sgrt.models.config import ModelConfig
from sgrt.models.registry import Family, base_config


def config_from_hf(cfg: dict) -> ModelConfig:
    """Phi-3's HF config -> :class:`ModelConfig`."""
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Phi-3")
    return base_config(cfg)


def fused_parts(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """Each layer's fused ``qkv_proj`` (q, k, v rows) and ``gate_up_proj`` (gate rows, then up)
    under Llama's names: ``[(name, first row, rows), ...]``; None for other tensors."""
    if name.endswith("self_attn.qkv_proj.weight"):
        base = name.removesuffix("qkv_proj.weight")
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return [(base + "q_proj.weight", 0, q), (base + "k_proj.weight", q, kv), (base + "v_proj.weight", q + kv, kv)]
    if name.endswith("mlp.gate_up_proj.weight"):
        base = name.removesuffix("gate_up_proj.weight")
        n = config.intermediate_size
        return [(base + "gate_proj.weight", 0, n), (base + "up_proj.weight", n, n)]
    return None


def gguf_extras(hf: dict, meta, tensors: dict) -> None:
    """llama.cpp's Phi-3: long-rope factors as two tensors, the original length in metadata."""
    import gguf
    import numpy as np

    if "rope_factors_long.weight" in tensors:
        def factors(name: str) -> list[float]:
            t = tensors[name]
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).ravel().tolist()

        hf["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": factors("rope_factors_long.weight"),
            "short_factor": factors("rope_factors_short.weight"),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length",
                                                         hf["max_position_embeddings"])),
        }
        attn = meta("rope.scaling.attn_factor", None)
        if attn is not None:
            hf["rope_scaling"]["attention_factor"] = float(attn)


FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    config_from_hf=config_from_hf,
    fused_parts=fused_parts,
    gguf_block_names={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    gguf_extras=gguf_extras,
    stop_tokens=("<|end|>", "<|endoftext|>"),
)
