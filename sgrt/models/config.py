"""The shape of a decoder-only model, read from an HF ``config.json`` or GGUF metadata.

One dataclass covers every family in :mod:`sgrt.models.registry`: the Llama defaults plus the
switches the other families turn on (QKV bias, q/k norm, sandwich norms, GELU-tanh gating,
scaled embeddings, per-layer sliding windows, rotary variants). Each family's file fills it from
its own HF config (``Family.config_from_hf``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder (names as in HF configs where HF has one).

    Family switches (defaults = Llama):
        attention_bias: q/k/v projections have biases (Qwen2).
        qk_norm: RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3).
        sandwich_norms: extra RMSNorms on the attention and MLP outputs and before the MLP
            (Gemma 3's four norms a layer).
        norm_weight_offset: added to every RMSNorm weight at load (Gemma stores ``w`` and
            multiplies by ``1 + w``).
        hidden_act: ``"silu"`` or ``"gelu_pytorch_tanh"`` (the gate's activation).
        embed_scale: the embedding output is multiplied by this (Gemma: ``sqrt(hidden)``).
        query_pre_attn_scalar: attention scores use ``query_pre_attn_scalar ** -0.5`` instead of
            ``head_dim ** -0.5`` (Gemma).
        rope_parameters: the rotary variant of full-attention layers, HF's dict
            (``rope_type``, ``factor``, ...; :mod:`sgrt.models.rope`).
        rope_local_parameters: the rotary of sliding-window layers where it differs (Gemma 3's
            ``rope_local_base_freq``); None = same as ``rope_parameters``.
        sliding_window: window length in tokens (a query attends to itself and the
            ``sliding_window - 1`` tokens before it), for layers marked ``"sliding_attention"``.
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``; None = all full.
        final_logit_softcapping: ``tanh`` soft cap on the logits (None = off).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    head_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_weight_offset: float = 0.0
    hidden_act: str = "silu"
    embed_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_parameters: dict = field(default_factory=dict)
    rope_local_parameters: dict | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.rope_parameters:
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        self.rope_parameters.setdefault("rope_theta", self.rope_theta)

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return None

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention scores."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """The Llama reading of an HF config (other families: ``sgrt.models.registry``)."""
        from sgrt.models.rope import rope_parameters_from_hf

        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        rope = rope_parameters_from_hf(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope["rope_theta"]),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            head_dim=cfg.get("head_dim"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            architecture=archs[0],
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_parameters=rope,
            model_type=cfg.get("model_type", "llama"),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()))

    def to_hf_dict(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.LlamaConfig`` accepts (Llama only)."""
        d = asdict(self)
        for k in ("architecture", "qk_norm", "sandwich_norms", "norm_weight_offset", "embed_scale",
                  "query_pre_attn_scalar", "rope_local_parameters", "layer_types",
                  "final_logit_softcapping", "model_type", "sliding_window"):
            d.pop(k)
        d["architectures"] = [self.architecture]
        d["model_type"] = "llama"
        d["mlp_bias"] = False
        return d
