"""Gemma 3 family (text models: 270M, 1B, and the text stack of larger ones).

As HF ``Gemma3ForCausalLM`` implements it (Gemma Team, arXiv:2503.19786):

- interleaved layers: ``layer_types`` marks each ``sliding_attention`` (a window of
  ``sliding_window`` tokens) or ``full_attention``; older configs give
  ``sliding_window_pattern`` (every N-th layer is global, N = 6);
- local layers have their own rotary base (``rope_local_base_freq`` or the
  ``sliding_attention`` entry of ``rope_parameters``, default 10,000), global ones use
  ``rope_theta`` and its scaling;
- RMSNorm on each head of q and k, and four norms a layer (input, post-attention,
  pre-feedforward, post-feedforward);
- RMSNorm weights are stored zero-centred (the norm multiplies by ``1 + w``), folded into the
  weights at load;
- GELU-tanh gating, embeddings scaled by ``sqrt(hidden_size)``, scores scaled by
  ``query_pre_attn_scalar ** -0.5``.

llama.cpp's GGUF (``gemma3``) stores the norm weights as ``1 + w`` already and names the
sandwich norms ``post_attention_norm`` / ``ffn_norm`` / ``post_ffw_norm``.
"""
from __future__ import annotations

from sgrt.models.config import ModelConfig
from sgrt.models.registry import Family, base_config
from sgrt.models.rope import rope_parameters_from_hf

SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_THETA = 10000.0


def config_from_hf(cfg: dict) -> ModelConfig:
    """Gemma 3's HF (text) config -> :class:`ModelConfig`.

    Raises:
        ValueError: ``attn_logit_softcapping`` set (Gemma 2's score cap; not implemented), or
            ``attention_bias``.
    """
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attn_logit_softcapping is not supported")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Gemma 3")
    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if not layer_types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or SLIDING_WINDOW_PATTERN)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("sliding_attention"), dict):
        local = rope_parameters_from_hf({"rope_parameters": params["sliding_attention"]})
    else:
        local = {"rope_type": "default", "rope_theta": float(cfg.get("rope_local_base_freq") or LOCAL_ROPE_THETA)}
    return base_config(
        {**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)},
        layer_types=list(layer_types),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        qk_norm=True,
        sandwich_norms=True,
        norm_weight_offset=1.0,
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        rope_local_parameters=local,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def gguf_extras(hf: dict, meta, tensors: dict) -> None:
    """llama.cpp's Gemma 3: every 6th layer global, local rotary base 10,000, scores scaled by
    ``key_length ** -0.5``."""
    n = hf["num_hidden_layers"]
    hf["layer_types"] = ["full_attention" if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
                         for i in range(n)]
    hf["query_pre_attn_scalar"] = hf["head_dim"]
    hf["rope_local_base_freq"] = LOCAL_ROPE_THETA
    hf["hidden_activation"] = "gelu_pytorch_tanh"
    hf.pop("hidden_act", None)


FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    config_from_hf=config_from_hf,
    gguf_block_names={
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    gguf_norm_offset=1.0,
    gguf_extras=gguf_extras,
    stop_tokens=("<end_of_turn>", "<eos>"),
)
