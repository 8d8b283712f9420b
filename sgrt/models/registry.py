"""Model families: which checkpoints sgrt runs, and how each one's files read into our model.

A family (one small module each: :mod:`sgrt.models.llama`, ``qwen2``, ``qwen3``, ``mistral``,
``gemma3``, ``phi3``) is a :class:`Family` record: the names it answers to (HF ``architectures``
/ ``model_type``, GGUF ``general.architecture``), how its HF config fills a
:class:`~sgrt.models.config.ModelConfig`, how its weight names map to the canonical (Llama-named)
ones that :class:`sgrt.models.layers.CausalLM` loads, and how its GGUF metadata and tensor names
read. The model code itself is shared (:mod:`sgrt.models.layers`); the engine never sees a
family. Adding one: write a module with a ``FAMILY`` and list it in :data:`FAMILY_MODULES`.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sgrt.models.config import ModelConfig

FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")

# llama.cpp block tensor names -> canonical HF names (within ``model.layers.N.``); families
# override or extend this (``Family.gguf_block_names``).
GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _no_fused_tensors(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    return None


def _no_gguf_extras(hf: dict, meta: Callable[[str, Any], Any], tensors: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """One model family (module docstring).

    Attributes:
        name: short name (``"gemma3"``).
        hf_architectures: HF ``architectures`` entries it loads (the first is written for GGUFs).
        hf_model_types: HF ``model_type`` values (the first is written for GGUFs).
        gguf_architectures: GGUF ``general.architecture`` values.
        config_from_hf: HF config dict -> :class:`ModelConfig` (raises ``ValueError`` / ``KeyError``
            for what it cannot take).
        fused_parts: a checkpoint tensor that stacks several canonical (HF Llama-named) ones by
            rows -> ``[(canonical name, first row, rows), ...]``, else None (Phi-3's ``qkv_proj``
            is q, k and v; its ``gate_up_proj`` gate and up). :meth:`canonical_state` and the
            weight packer (:mod:`sgrt.models.weight_packer`) both split by it.
        gguf_block_names: overrides of :data:`GGUF_BLOCK_NAMES`.
        gguf_unpermute_qk: the GGUF's q/k rows are in llama.cpp's interleaved rotary order.
        gguf_norm_offset: llama.cpp stored ``w + offset`` for every norm weight (Gemma: 1).
        gguf_extras: fills family-specific HF config keys from GGUF metadata (``meta(key,
            default)`` reads ``<arch>.<key>``; ``tensors``: GGUF tensors by name).
        stop_tokens: its end-of-turn tokens (they join the tokenizer's stop set when present).
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    config_from_hf: Callable[[dict], ModelConfig]
    fused_parts: Callable[[str, ModelConfig], list[tuple[str, int, int]] | None] = _no_fused_tensors
    gguf_block_names: dict[str, str] = field(default_factory=dict)
    gguf_unpermute_qk: bool = False
    gguf_norm_offset: float = 0.0
    gguf_extras: Callable[[dict, Callable[[str, Any], Any], dict], None] = _no_gguf_extras
    stop_tokens: tuple[str, ...] = ()

    def canonical_state(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under the canonical (HF Llama) names: fused ones split into
        row views by :attr:`fused_parts`, the rest as they are."""
        out: dict[str, torch.Tensor] = {}
        for name, w in state.items():
            parts = self.fused_parts(name, config)
            if parts is None:
                out[name] = w
            else:
                out.update((part, w[row0: row0 + rows]) for part, row0, rows in parts)
        return out

    def gguf_hf_name(self, gguf_name: str) -> str | None:
        """llama.cpp tensor name -> the HF name this family's checkpoints use (before
        :meth:`canonical_state`); None if unknown."""
        if gguf_name in GGUF_GLOBAL_NAMES:
            return GGUF_GLOBAL_NAMES[gguf_name]
        parts = gguf_name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            name = self.gguf_block_names.get(parts[2], GGUF_BLOCK_NAMES.get(parts[2]))
            if name is not None:
                return f"model.layers.{parts[1]}.{name}"
        return None


_families: list[Family] | None = None


def families() -> list[Family]:
    """Every registered family, in :data:`FAMILY_MODULES` order."""
    global _families
    if _families is None:
        _families = [importlib.import_module(f"sgrt.models.{m}").FAMILY for m in FAMILY_MODULES]
    return _families


def family_for_hf(cfg: dict) -> Family | None:
    """The family of an HF config dict (by ``architectures``, else ``model_type``), or None."""
    archs = cfg.get("architectures") or []
    for fam in families():
        if archs and all(a in fam.hf_architectures for a in archs):
            return fam
    if not archs:
        for fam in families():
            if cfg.get("model_type") in fam.hf_model_types:
                return fam
    return None


def family_for_gguf(arch: str | None) -> Family | None:
    """The family of a GGUF ``general.architecture`` value, or None."""
    for fam in families():
        if arch in fam.gguf_architectures:
            return fam
    return None


def supported_names() -> dict[str, list[str]]:
    """``{"hf": [...architectures], "gguf": [...architectures]}`` for error messages and docs."""
    return {"hf": [a for f in families() for a in f.hf_architectures],
            "gguf": [a for f in families() for a in f.gguf_architectures]}


def base_config(cfg: dict, **overrides: Any) -> ModelConfig:
    """The fields every family reads the same way (Llama's reading of an HF config, with the
    sliding window and per-layer types where the config has them), then ``overrides``."""
    config = ModelConfig.from_hf_dict(cfg)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    config.sliding_window = int(window) if window else None
    config.layer_types = list(cfg["layer_types"]) if cfg.get("layer_types") else None
    config.hidden_act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported")
    for k, v in overrides.items():
        setattr(config, k, v)
    return config
