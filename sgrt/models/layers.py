"""Shared decoder layers of every family: norms, rotary, attention call, gated MLP, the model.

One :class:`CausalLM` serves all families in :mod:`sgrt.models.registry`; a family is a reading
of its checkpoint into a :class:`sgrt.models.config.ModelConfig` (whose switches turn on QKV
bias, q/k norm, sandwich norms, GELU-tanh gating, embedding scale, sliding windows, rotary
variants) plus the names of its weights. Parameter names are HF Llama's (with HF's names for the
extra norms) so that HF folders load as they are; q/k/v and gate/up are fused into one matmul
each to cut per-layer overhead on the decode path.

Attention is delegated to the ``attn`` object that the engine passes in (see
:mod:`sgrt.engine.attention`): it writes K/V into the KV pool and attends over each row's slots,
within the layer's sliding window where it has one, so this module holds no cache state.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sgrt.models.config import ModelConfig
from sgrt.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from sgrt.models.native_step import NativeDecodeStep

logger = logging.getLogger("sgrt.models")

# Our fused projections of each decoder layer -> the canonical HF weights they stack, in row order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")


class AttentionBackend(Protocol):
    """What the model needs from the engine to run attention for one forward.

    A backend may also offer ``native_decode(layer_id, window)`` (see
    ``sgrt.engine.attention.PagedAttention.native_decode``), through which the native layer ops
    run a decode layer's whole attention block in one operator call."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        """q ``[T, n_heads, head_dim]``, k/v ``[T, n_kv_heads, head_dim]`` (possibly strided views)
        -> ``[T, n_heads*head_dim]``; softmax scale ``head_dim ** -0.5``; ``window``: each query
        sees only the ``window`` latest positions up to its own (None = all)."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, arXiv:1910.07467), computed in float32.

    Gemma's ``1 + w`` form is folded into ``weight`` at load (``ModelConfig.norm_weight_offset``).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: F.rms_norm is x * rsqrt(mean(x**2) + eps), bit-identical to writing it out (checked
        # in float32 and bfloat16), in fewer dispatched ops.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, head_dim]``; cos/sin ``[T, rd]`` -> a new ``[T, heads, head_dim]`` whose
    first ``rd`` channels are rotated (HF rotate-half) and the rest passed through."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = rd // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class LayerOps:
    """A decoder layer's non-matmul steps in plain PyTorch: the reference, and the path on CUDA."""

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then RMSNorm: ``x + delta`` (or ``x`` when ``delta`` is None) and its norm."""
        if delta is not None:
            x = x + delta
        return x, norm(x)

    def qk_norm(self, layer: "DecoderLayer", qkv: torch.Tensor) -> torch.Tensor:
        """The layer's per-head RMSNorm of q and k (Qwen3, Gemma 3): qkv ``[T, (n_heads + 2 *
        n_kv_heads) * head_dim]`` -> ``[T, n_heads + 2 * n_kv_heads, head_dim]`` with q and k
        normed, v as it was (qkv itself, changed in place). Each q head by ``q_norm``, each k head
        by ``k_norm``, as :meth:`RMSNorm.forward` computes them, in one ``rms_norm`` over the q and
        k heads together and one multiply by their weights written back into qkv (the same bits as
        two norms and a ``cat``, without copying qkv: ``tests/models/test_qk_norm.py``)."""
        qkv = qkv.view(qkv.shape[0], layer.n_heads + 2 * layer.n_kv_heads, layer.head_dim)
        qk = qkv[:, : layer.n_heads + layer.n_kv_heads]
        weight = torch.cat((layer.q_norm.weight.expand(layer.n_heads, -1),
                            layer.k_norm.weight.expand(layer.n_kv_heads, -1)))
        normed = F.rms_norm(qk.float(), (layer.head_dim,), eps=layer.q_norm.eps).to(qkv.dtype)
        torch.mul(weight, normed, out=qk)
        return qkv

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk ``[T, heads, head_dim]`` (may be a view into the QKV output) -> rotated."""
        return apply_rotary(qk, cos, sin)

    def rotary_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                   n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv ``[T, n_heads + 2 * n_kv_heads, head_dim]`` -> q (rotated) ``[T, n_heads, head_dim]``,
        k (rotated) and v ``[T, n_kv_heads, head_dim]``; q and k rotate together (one call)."""
        n_qk = n_heads + n_kv_heads
        q, k = self.rotary(qkv[:, :n_qk], cos, sin).split([n_heads, n_kv_heads], dim=1)
        return q, k, qkv[:, n_qk:]

    def attention(self, layer: "DecoderLayer", qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttentionBackend) -> torch.Tensor:
        """A layer's attention block between its QKV and output projections: rotary on q and k,
        q's pre-scale, then ``attn`` (which stores k/v in the KV pool and attends).
        qkv ``[T, (n_heads + 2 * n_kv_heads) * head_dim]`` or that viewed as ``[T, heads, head_dim]``
        (may be changed in place) -> ``[T, n_heads * head_dim]``."""
        qkv = qkv.view(qkv.shape[0], layer.n_heads + 2 * layer.n_kv_heads, layer.head_dim)
        q, k, v = self.rotary_qkv(qkv, cos, sin, layer.n_heads, layer.n_kv_heads)  # views into qkv
        if layer.q_scale != 1.0:
            q = q * layer.q_scale
        if layer.window is None:
            return attn.forward(layer.layer_id, q, k, v)
        return attn.forward(layer.layer_id, q, k, v, window=layer.window)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` -> ``silu(gate) * up`` ``[T, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` -> ``gelu_tanh(gate) * up`` ``[T, I]`` (Gemma's gating)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class NativeLayerOps(LayerOps):
    """The same steps as fused CPU operators (:mod:`sgrt.kernels.layer_ops`), one call each;
    ``x`` is updated in place by the residual add. Same rounding points as :class:`LayerOps`.
    Build it after ``sgrt.kernels.layer_ops.available()`` returned True. Partial rotary falls
    back to :class:`LayerOps` (the operator rotates whole heads)."""

    def __init__(self) -> None:
        from sgrt.kernels.layer_ops import op

        self._rms_norm, self._add_rms_norm = op("rms_norm"), op("add_rms_norm_")
        self._rotary, self._silu_mul, self._gelu_mul = op("rotary_"), op("silu_mul"), op("gelu_tanh_mul")
        self._rotary_heads, self._decode_attention_qkv = op("rotary_heads_"), op("decode_attention_qkv_")
        self._qk_norm = op("qk_norm_")

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        weight = norm._parameters["weight"]  # (not norm.weight: see DecoderLayer.forward's NOTE)
        if delta is None:
            return x, self._rms_norm(x, weight, norm.eps)
        return x, self._add_rms_norm(x, delta, weight, norm.eps)

    def qk_norm(self, layer: "DecoderLayer", qkv: torch.Tensor) -> torch.Tensor:
        # in place, one call (the decode plan's qk_norm_ too); the weights as add_norm reads them
        qkv = qkv.view(qkv.shape[0], layer.n_heads + 2 * layer.n_kv_heads, layer.head_dim)
        mods = layer._modules
        q_norm = mods["q_norm"]
        return self._qk_norm(qkv, q_norm._parameters["weight"], mods["k_norm"]._parameters["weight"], layer.n_heads,
                             q_norm.eps)

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if cos.shape[-1] != qk.shape[-1]:
            return apply_rotary(qk, cos, sin)
        return self._rotary(qk, cos, sin)

    def rotary_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                   n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if cos.shape[-1] != qkv.shape[-1]:
            return super().rotary_qkv(qkv, cos, sin, n_heads, n_kv_heads)
        # NOTE: in place on qkv, then torch.split_with_sizes (C++) rather than slicing and
        # Tensor.split, whose Python wrapper alone costs more than the rotation.
        self._rotary_heads(qkv, cos, sin, n_heads + n_kv_heads)
        return torch.split_with_sizes(qkv, [n_heads, n_kv_heads, n_kv_heads], 1)

    def attention(self, layer: "DecoderLayer", qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttentionBackend) -> torch.Tensor:
        # A decode-only forward over the KV pool (PagedAttention.native_decode): rotary, q's
        # pre-scale, the K/V store and attention in one operator call instead of four.
        native_decode = getattr(attn, "native_decode", None)
        if native_decode is not None and cos.shape[-1] == layer.head_dim:
            args = native_decode(layer.layer_id, layer.window)
            if args is not None:
                return self._decode_attention_qkv(qkv, cos, sin, layer.n_heads, layer.q_scale, *args)
        return super().attention(layer, qkv, cos, sin, attn)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gelu_mul(gate_up)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free ``nn.Linear`` whose weight is ``torch.empty`` (on the default device): its
    ``__init__`` without the random init. A loader sets every weight, and the init, on the meta
    device too, ran through torch's decompositions (~0.08 s of a 1B model's load; as
    ``skip_init``'s ``to_empty`` does)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    layer.weight = nn.Parameter(torch.empty(out_features, in_features))
    layer.register_parameter("bias", None)
    return layer


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention then a gated MLP, each with a residual.

    With ``config.sandwich_norms`` (Gemma 3) the attention and MLP outputs are normed before the
    residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``) and the MLP
    input by ``pre_feedforward_layernorm``; otherwise ``post_attention_layernorm`` is the MLP
    input's norm (Llama naming).
    """

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.window = config.layer_window(layer_id)
        # Rotary table of this layer: 1 = the local one (Gemma 3's sliding layers), 0 = the main one.
        self.rope_id = 1 if (self.window is not None and config.rope_local_parameters) else 0
        # The attention backends scale scores by head_dim ** -0.5; other scales pre-scale q.
        self.q_scale = config.attention_scale * self.head_dim ** 0.5
        self.gelu = config.hidden_act != "silu"
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.q_norm = RMSNorm(self.head_dim, eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if config.qk_norm else None
        self.qkv_proj = _linear(hidden, self.q_size + 2 * self.kv_size)
        # NOTE: the bias lives outside the projection, so that packing and quantization, which
        # replace qkv_proj, keep it.
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if config.attention_bias else None
        self.o_proj = _linear(self.q_size, hidden)
        self.gate_up_proj = _linear(hidden, 2 * config.intermediate_size)
        self.down_proj = _linear(config.intermediate_size, hidden)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream ``[T, hidden]``; delta: the previous layer's output, not yet
        added to it (None for the first layer); rope: (cos, sin) ``[T, rotary_dim]`` per rotary
        table of the model. Returns the new (x, delta): adding each layer's output is left to
        the next layer's norm, where the fused path does both in one call.

        NOTE: a decode-only forward on the native path runs this in C++ instead (``DecodePlan``
        in ``sgrt/kernels/layer_ops_cpu/decode_plan.cpp``, :mod:`sgrt.models.native_step`), which
        must call the same operators in the same order: change both together
        (``tests/models/test_native_step.py`` compares them bit for bit for every family's
        switches)."""
        # NOTE: submodules' forward() is called directly: nn.Module.__call__ (hook dispatch) costs
        # ~1.5 us a call, 5 calls a layer, 150 a decode step. Module hooks do not run here. They
        # are read from self._modules: attribute access to a submodule goes through
        # nn.Module.__getattr__ (~1.5 us on the 2-core machine, 6 a layer, 180 a decode step).
        mods = self._modules
        x, h = ops.add_norm(x, delta, mods["input_layernorm"])
        qkv = mods["qkv_proj"].forward(h)  # [T, (n_heads + 2 * n_kv_heads) * head_dim]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_norm is not None:
            qkv = ops.qk_norm(self, qkv)
        cos, sin = rope[self.rope_id]
        o = mods["o_proj"].forward(ops.attention(self, qkv, cos, sin, attn))
        if self.sandwich:
            o = ops.add_norm(o, None, mods["post_attention_layernorm"])[1]
            x, h = ops.add_norm(x, o, mods["pre_feedforward_layernorm"])
        else:
            x, h = ops.add_norm(x, o, mods["post_attention_layernorm"])
        gate_up = mods["gate_up_proj"].forward(h)
        if self.gelu:
            m = mods["down_proj"].forward(ops.gelu_mul(gate_up))
        else:
            m = mods["down_proj"].forward(ops.silu_mul(gate_up))
        if self.sandwich:
            m = ops.add_norm(m, None, mods["post_feedforward_layernorm"])[1]
        return x, m


class CausalLM(nn.Module):
    """A decoder-only causal LM of any registered family, whose forward runs over a ragged batch.

    Args:
        config: the model's shape and family switches.
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).
        device: ``cpu`` or ``cuda``.
        materialize: allocate the parameters (uninitialized, for :meth:`load_weights`); False
            leaves them on the meta device, for a loader that sets each one to a tensor it has
            (:mod:`sgrt.models.assemble`: a weight store's mapped tensors).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 materialize: bool = True):
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: {ACTIVATIONS})")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        with torch.device("meta"):
            # NOTE: with its own empty weight, so that Embedding skips its random init: on the
            # meta device that runs through torch._refs, which imports torch._dynamo and triton
            # (~3 s and ~70 MB of a load).
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                             _weight=torch.empty(config.vocab_size, config.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = None if config.tie_word_embeddings else _linear(config.hidden_size, config.vocab_size)
        if materialize:
            self.to_empty(device=self.device)
            self.to(dtype)
        # Per-layer sliding windows (None = full attention): what the KV pool's users need to know.
        self.layer_windows: list[int | None] = [layer.window for layer in self.layers]
        tables = [config.rope_parameters]
        if config.rope_local_parameters:
            tables.append(config.rope_local_parameters)
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(p, config.head_dim, config.max_position_embeddings, self.device) for p in tables
        )
        # A quantized (sgrt.models.quant) or oneDNN-prepacked (sgrt.models.packed) copy of the LM head;
        # the embedding stays a lookup table. It serves batches of up to logits_head_max_rows rows;
        # larger ones use the plain float head.
        self.logits_head: nn.Module | None = None
        self.logits_head_max_rows = 1 << 62
        self.quantization = "none"
        # Fused CPU operators for the non-matmul steps (sgrt.kernels.layer_ops), where they load,
        # and with them the whole decode step in one native call where every layer fits it.
        self.layer_ops: LayerOps = LayerOps()
        self.native_step: NativeDecodeStep | None = None
        self.requires_grad_(False)
        self.eval()

    @property
    def rotary(self) -> RotaryEmbedding:
        """The main rotary table (full-attention layers)."""
        return self.rotaries[0]

    def cover_positions(self, positions: int) -> None:
        """Make the rotary tables cover positions ``0 .. positions - 1`` (they start short and
        grow: :class:`~sgrt.models.rope.RotaryEmbedding`); the decode plan is rebuilt over grown
        ones. Callers run it before a forward that reaches past :attr:`RotaryEmbedding.rows`."""
        grown = [r.grow(positions) for r in self.rotaries]
        if any(grown) and getattr(self, "native_step", None) is not None:
            self._build_native_step()

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy canonical HF-named weights in (Llama names; families rename theirs first, see
        ``Family.canonical_state``), fusing q/k/v and gate/up and adding
        ``config.norm_weight_offset`` to every norm weight.

        Raises:
            KeyError: a weight the model needs is missing (message names it).
        """
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        offset = self.config.norm_weight_offset

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return sd[name]

        def norm(param: torch.Tensor, name: str) -> None:
            w = take(name).float()
            param.copy_(w + offset if offset else w)

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("embed_tokens.weight"))
            norm(self.norm.weight, "norm.weight")
            if self.lm_head is not None:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                norm(layer.input_layernorm.weight, p + "input_layernorm.weight")
                norm(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
                if layer.sandwich:
                    norm(layer.pre_feedforward_layernorm.weight, p + "pre_feedforward_layernorm.weight")
                    norm(layer.post_feedforward_layernorm.weight, p + "post_feedforward_layernorm.weight")
                if layer.q_norm is not None:
                    norm(layer.q_norm.weight, p + "self_attn.q_norm.weight")
                    norm(layer.k_norm.weight, p + "self_attn.k_norm.weight")
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([take(p + b) for b in QKV_BIASES]))
                for fused, parts in FUSED_PROJECTIONS.items():
                    getattr(layer, fused).weight.copy_(torch.cat([take(p + part) for part in parts]))

    # -- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                ops: LayerOps | None = None) -> torch.Tensor:
        """input_ids, positions ``[T]`` int64 -> final hidden states ``[T, hidden]`` (model dtype).
        ``ops``: the layers' non-matmul steps, default the model's own (:meth:`use_native_ops`);
        with the default, a decode-only forward runs in one native call where the model has a
        decode plan (:mod:`sgrt.models.native_step`: the same operators, bit-identical)."""
        if ops is None and self.native_step is not None:
            hidden = self.native_step.forward(input_ids, positions, attn)
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        rope = [r.cos_sin(positions, x.dtype) for r in self.rotaries]
        ops = self.layer_ops if ops is None else ops
        delta = None
        for layer in self.layers:
            x, delta = layer.forward(x, delta, rope, attn, ops)  # (see DecoderLayer.forward's NOTE)
        return ops.add_norm(x, delta, self.norm)[1]

    def use_native_ops(self, enable: bool = True) -> bool:
        """Run the non-matmul steps (and decode attention, see :mod:`sgrt.engine.attention`)
        through the fused CPU operators of :mod:`sgrt.kernels.layer_ops`, which compile on first
        use, and with them, where every layer fits it, the one-call decode step
        (:attr:`native_step`, :mod:`sgrt.models.native_step`). Returns whether they are now in
        use: False off the CPU, for dtypes other than float32 / bfloat16, or where the operators
        cannot be built (a warning says why)."""
        from sgrt.kernels import layer_ops

        native = (enable and self.device.type == "cpu" and self.dtype in layer_ops.DTYPES
                  and layer_ops.available())
        self.layer_ops = NativeLayerOps() if native else LayerOps()
        self._build_native_step()
        return native

    def _build_native_step(self) -> None:
        """(Re)build the one-call decode step (:mod:`sgrt.models.native_step`) for the current
        layers; replacing a layer's modules after :meth:`use_native_ops` needs another call of it."""
        from sgrt.models import native_step

        self.native_step = None
        if self.native_ops:
            self.native_step, why = native_step.build(self)
            if self.native_step is None:
                logger.info("decode step layer by layer (no one-call native step): %s", why)

    def _apply(self, fn, recurse=True):  # .to() / .float() replace the weights the plan holds
        out = super()._apply(fn, recurse)
        if getattr(self, "native_step", None) is not None:
            self._build_native_step()
        return out

    @property
    def native_ops(self) -> bool:
        """Whether the fused CPU operators are in use (:meth:`use_native_ops`)."""
        return isinstance(self.layer_ops, NativeLayerOps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden]`` -> logits ``[N, vocab]`` float32."""
        if self.logits_head is not None and hidden.shape[0] <= self.logits_head_max_rows:
            # (a head that widens its output as it writes it saves a pass over the logits)
            widened = getattr(self.logits_head, "forward_float", None)
            logits = widened(hidden) if widened is not None else self.logits_head(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward_simple(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One causal pass over a single sequence without a KV pool (tests, references).

        input_ids ``[T]`` int64 -> logits ``[T, vocab]`` float32.
        """
        input_ids = input_ids.to(self.device)
        self.cover_positions(input_ids.shape[0])
        positions = torch.arange(input_ids.shape[0], device=self.device)
        hidden = self.forward(input_ids, positions, CausalAttention())
        return self.compute_logits(hidden)


class CausalAttention:
    """Plain causal self-attention over one contiguous sequence (no cache), windowed on request."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        t = q.shape[0]
        mask = None
        if window is not None and window < t:
            i = torch.arange(t)
            mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)).to(q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1).reshape(t, -1)
