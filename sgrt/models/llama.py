"""Llama-family decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Follows the architecture of Touvron et al., "LLaMA" (arXiv:2302.13971) as implemented by HF
``transformers.LlamaForCausalLM``; parameter names are HF's so that HF folders load as they are.
The query/key/value and gate/up projections are fused into one matmul each to cut per-layer
overhead on the decode path. Attention itself is delegated to the ``attn`` object that the
engine passes in (see :mod:`sgrt.engine.attention`): it writes K/V into the KV pool and attends
over each row's slot indices, so this module holds no cache state.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sgrt.models.config import ModelConfig


# Our fused projections of each decoder layer -> the HF weights they stack, in row order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


class AttentionBackend(Protocol):
    """What the model needs from the engine to run attention for one forward."""

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q ``[T, n_heads, head_dim]``, k/v ``[T, n_kv_heads, head_dim]`` (possibly strided views)
        -> ``[T, n_heads*head_dim]``."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, arXiv:1910.07467), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: F.rms_norm is x * rsqrt(mean(x**2) + eps), bit-identical to writing it out (checked
        # in float32 and bfloat16), in fewer dispatched ops.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., arXiv:2104.09864), HF "rotate half" layout."""

    def __init__(self, head_dim: int, max_positions: int, base: float, device: torch.device):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 -> cos, sin ``[T, head_dim]`` in ``dtype``."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, head_dim]``; cos/sin ``[T, head_dim]`` -> a new ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class LayerOps:
    """A decoder layer's non-matmul steps in plain PyTorch: the reference, and the path on CUDA."""

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then RMSNorm: ``x + delta`` (or ``x`` when ``delta`` is None) and its norm."""
        if delta is not None:
            x = x + delta
        return x, norm(x)

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk ``[T, heads, head_dim]`` (may be a view into the QKV output) -> rotated."""
        return apply_rotary(qk, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` -> ``silu(gate) * up`` ``[T, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeLayerOps(LayerOps):
    """The same steps as fused CPU operators (:mod:`sgrt.kernels.layer_ops`), one call each;
    ``x`` is updated in place by the residual add. Same rounding points as :class:`LayerOps`.
    Build it after ``sgrt.kernels.layer_ops.available()`` returned True."""

    def __init__(self) -> None:
        from sgrt.kernels.layer_ops import op

        self._rms_norm, self._add_rms_norm = op("rms_norm"), op("add_rms_norm_")
        self._rotary, self._silu_mul = op("rotary_"), op("silu_mul")

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return x, self._rms_norm(x, norm.weight, norm.eps)
        return x, self._add_rms_norm(x, delta, norm.weight, norm.eps)

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._rotary(qk, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gate_up)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.gate_up_proj = nn.Linear(hidden, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream ``[T, hidden]``; delta: the previous layer's output, not yet
        added to it (None for the first layer); cos/sin ``[T, head_dim]``.
        Returns the new (x, delta): adding each layer's output is left to the next layer's norm,
        where the fused path does both in one call."""
        # NOTE: submodules' forward() is called directly: nn.Module.__call__ (hook dispatch) costs
        # ~1.5 us a call, 5 calls a layer, 150 a decode step. Module hooks do not run here.
        t = x.shape[0]
        x, h = ops.add_norm(x, delta, self.input_layernorm)
        qkv = self.qkv_proj.forward(h).view(t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        # q and k rotate together: one call for both (q, k, v: views into qkv).
        qk = ops.rotary(qkv[:, : self.n_heads + self.n_kv_heads], cos, sin)
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        v = qkv[:, self.n_heads + self.n_kv_heads:]
        x, h = ops.add_norm(x, self.o_proj.forward(attn.forward(self.layer_id, q, k, v)), self.post_attention_layernorm)
        return x, self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(h)))


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose forward runs over a ragged batch of tokens.

    Args:
        config: the model's shape.
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).
        device: ``cpu`` or ``cuda``.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = None if config.tie_word_embeddings else nn.Linear(
                config.hidden_size, config.vocab_size, bias=False
            )
        self.to_empty(device=self.device)
        self.to(dtype)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, self.device
        )
        # A quantized (sgrt.models.quant) or oneDNN-prepacked (sgrt.models.packed) copy of the LM head;
        # the embedding stays a lookup table. It serves batches of up to logits_head_max_rows rows;
        # larger ones use the plain float head.
        self.logits_head: nn.Module | None = None
        self.logits_head_max_rows = 1 << 62
        self.quantization = "none"
        # Fused CPU operators for the non-matmul steps (sgrt.kernels.layer_ops), where they load.
        self.layer_ops: LayerOps = LayerOps()
        self.requires_grad_(False)
        self.eval()

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up.

        Raises:
            KeyError: a weight the model needs is missing (message names it).
        """
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return sd[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("embed_tokens.weight"))
            self.norm.weight.copy_(take("norm.weight"))
            if self.lm_head is not None:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
                for fused, parts in FUSED_PROJECTIONS.items():
                    getattr(layer, fused).weight.copy_(torch.cat([take(p + part) for part in parts]))

    # -- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                ops: LayerOps | None = None) -> torch.Tensor:
        """input_ids, positions ``[T]`` int64 -> final hidden states ``[T, hidden]`` (model dtype).
        ``ops``: the layers' non-matmul steps, default the model's own (:meth:`use_native_ops`)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        ops = self.layer_ops if ops is None else ops
        delta = None
        for layer in self.layers:
            x, delta = layer.forward(x, delta, cos, sin, attn, ops)  # (see DecoderLayer.forward's NOTE)
        return ops.add_norm(x, delta, self.norm)[1]

    def use_native_ops(self, enable: bool = True) -> bool:
        """Run the non-matmul steps (and decode attention, see :mod:`sgrt.engine.attention`)
        through the fused CPU operators of :mod:`sgrt.kernels.layer_ops`, which compile on first
        use. Returns whether they are now in use: False off the CPU, for dtypes other than
        float32 / bfloat16, or where the operators cannot be built (a warning says why)."""
        from sgrt.kernels import layer_ops

        native = (enable and self.device.type == "cpu" and self.dtype in layer_ops.DTYPES
                  and layer_ops.available())
        self.layer_ops = NativeLayerOps() if native else LayerOps()
        return native

    @property
    def native_ops(self) -> bool:
        """Whether the fused CPU operators are in use (:meth:`use_native_ops`)."""
        return isinstance(self.layer_ops, NativeLayerOps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden]`` -> logits ``[N, vocab]`` float32."""
        if self.logits_head is not None and hidden.shape[0] <= self.logits_head_max_rows:
            return self.logits_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def forward_simple(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One causal pass over a single sequence without a KV pool (tests, references).

        input_ids ``[T]`` int64 -> logits ``[T, vocab]`` float32.
        """
        input_ids = input_ids.to(self.device)
        positions = torch.arange(input_ids.shape[0], device=self.device)
        hidden = self.forward(input_ids, positions, _CausalAttention())
        return self.compute_logits(hidden)


class _CausalAttention:
    """Plain causal self-attention over one contiguous sequence (no cache)."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)
