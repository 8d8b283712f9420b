"""A decode step in one native call: every decoder layer of a model on the CPU fast path.

A batch-1 decode step of a small model on a CPU is bound by per-op overhead, not by its kernels:
``DecoderLayer.forward`` makes ~8 Python -> operator round trips a layer (norms, projections,
attention), ~100 us a layer on the 2-core development machine against ~90 us of kernel time for
SmolLM2-135M int4 (issue 21). :class:`NativeDecodeStep` hands the whole stack to
``torch.classes.sgrt_layer.DecodePlan`` (``sgrt/kernels/layer_ops_cpu/decode_plan.cpp``), which
runs the embedding, every layer and the final norm in one call, calling the same operators in the
same order as the per-layer native path (:class:`sgrt.models.layers.NativeLayerOps`), so that its
hidden states and the K/V it writes are bit-identical to that path's
(``tests/models/test_native_step.py``).

The plan is built once per model (:func:`build`, from ``CausalLM.use_native_ops``): it holds
references to the model's own weights (no copies). It is built only where every piece has a
native counterpart; otherwise the model keeps the per-layer path, and :func:`build` says why:

- projections: :class:`~sgrt.models.quant_native.GroupLinear` (int4 / int8, bfloat16 model) or
  :class:`~sgrt.models.packed.DenseLinear` (float32 / bfloat16); not torch's quantized layers,
  oneDNN's prepacked ones, plain ``nn.Linear`` or any wrapper;
- rotary over whole heads (partial rotary, e.g. Phi-3's tiny test checkpoints, takes the
  per-layer path, whose native operator rotates whole heads too);
- a CPU model on the fused operators (:meth:`~sgrt.models.layers.CausalLM.use_native_ops`).

Per step, :meth:`NativeDecodeStep.forward` takes the fast path only for a decode-only forward
over the KV pool (``PagedAttention.native_decode`` gives the slot tables: every row one new
token) of at most :attr:`NativeDecodeStep.max_rows` rows (the dense kernel's limit, above which
``DenseLinear`` switches to another matmul); otherwise it returns None and the caller runs the
layers one by one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("sgrt.models")

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
         "q_norm", "k_norm")


@dataclass
class NativeDecodeStep:
    """A model's :class:`DecodePlan` and what a step needs to call it.

    Attributes:
        plan: ``torch.classes.sgrt_layer.DecodePlan`` holding the model's weights and switches.
        tables: per slot table of the plan, ``(a layer that uses it, its sliding window or None)``:
            the arguments of ``PagedAttention.native_decode`` that give that table.
        max_rows: the largest decode batch the plan serves (rows of the dense kernel).
    """

    plan: torch.ScriptObject
    tables: list[tuple[int, int | None]]
    max_rows: int
    embed: torch.nn.Module | None = None  # a quantized table's lookup (GroupEmbedding), run before the plan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        """input_ids, positions ``[B]`` int64 -> final hidden states ``[B, hidden]`` (model dtype),
        as ``CausalLM.forward`` returns them; None where this forward is not a decode-only one
        over a KV pool on the native path, or has more than :attr:`max_rows` rows."""
        native_decode = getattr(attn, "native_decode", None)
        if native_decode is None or input_ids.shape[0] > self.max_rows:
            return None
        slots, lens = [], []
        args = None
        for layer_id, window in self.tables:
            args = native_decode(layer_id, window)
            if args is None:
                return None
            slots.append(args[3])
            lens.append(args[4])
        pool = attn.pool
        embedded = self.embed(input_ids) if self.embed is not None else None
        # (an int8 pool's per-layer scales, else none: native_decode's last two arguments are None)
        k_scales, v_scales = ((pool.k_scale_layers, pool.v_scale_layers) if args[5] is not None else ([], []))
        return self.plan.forward(input_ids, positions, pool.k_layers, pool.v_layers, args[2], slots, lens, embedded,
                                 k_scales, v_scales)


def build(model) -> tuple[NativeDecodeStep | None, str]:
    """The decode plan of ``model`` (a :class:`sgrt.models.layers.CausalLM` whose native layer ops
    are on), or None and the reason the per-layer path stays (module docstring)."""
    from torch import nn

    from sgrt.models.packed import DenseLinear
    from sgrt.models.quant_base import KERNEL_DTYPE
    from sgrt.models.quant_native import GroupEmbedding, GroupLinear

    if not model.native_ops:
        return None, "the native layer ops are off"
    config = model.config
    if model.norm.weight.device.type != "cpu":
        return None, f"weights on {model.norm.weight.device}"
    if type(model.embed_tokens) is GroupEmbedding:  # (looked up in Python, then handed to the plan)
        lookup, table = model.embed_tokens, torch.empty(0, config.hidden_size, dtype=model.dtype)
    elif type(model.embed_tokens) is nn.Embedding:
        lookup, table = None, model.embed_tokens.weight
    else:
        return None, f"embedding is {type(model.embed_tokens).__name__}"
    rotary = [r.rotary_dim for r in model.rotaries]
    if any(d != config.head_dim for d in rotary):
        return None, f"partial rotary ({rotary} of head_dim {config.head_dim})"
    if config.head_dim % 2:  # (rotary rotates halves: the plan takes even head_dims only)
        return None, f"odd head_dim {config.head_dim}"
    # (the norms are read by name, not by type: importing sgrt.models.layers here would make an
    # import cycle with it, which builds the plan)
    eps = {model.norm.eps}
    for layer in model.layers:
        eps.update(m.eps for name, m in layer._modules.items() if name in NORMS and m is not None)
    if len(eps) != 1:
        return None, "RMSNorms with different eps"
    projections = []  # per layer: {name: (op, weight, scales, offsets, n, k, bits, group)}
    max_rows = 1 << 62
    for layer in model.layers:
        per_layer = {}
        for name in PROJECTIONS:
            mod = layer._modules[name]
            if type(mod) is GroupLinear and model.dtype == KERNEL_DTYPE:
                op = _woq_op(mod.activations)
                if op is None:
                    return None, "the weight-only kernel's operator is not loaded"
                packed, scales, offsets, n, k, bits, group = mod._args
                per_layer[name] = (op, packed, scales, offsets, n, k, bits, group)
            elif type(mod) is DenseLinear and mod.weight.dtype == model.dtype:
                weight = mod._parameters["weight"]
                if not weight.is_contiguous():
                    return None, f"layers.{layer.layer_id}.{name}: non-contiguous weight"
                empty = weight.new_empty(0)
                per_layer[name] = ("sgrt_dense_avx2::linear", weight, empty, empty, 0, 0, 0, 0)
                max_rows = min(max_rows, mod.max_rows)
            else:
                return None, f"layers.{layer.layer_id}.{name} is {type(mod).__name__} ({model.dtype})"
        projections.append(per_layer)

    embed_scale = None
    if config.embed_scale is not None:  # (CausalLM.forward's rounding of the scale to the dtype)
        embed_scale = torch.tensor(config.embed_scale, dtype=model.dtype)
    plan = torch.classes.sgrt_layer.DecodePlan(
        table, embed_scale, model.norm.weight, float(next(iter(eps))),
        config.num_attention_heads, config.head_dim,
        [r.cos for r in model.rotaries], [r.sin for r in model.rotaries])
    windows: list[int | None] = []
    tables: list[tuple[int, int | None]] = []
    for layer, per_layer in zip(model.layers, projections):
        if layer.window not in windows:
            windows.append(layer.window)
            tables.append((layer.layer_id, layer.window))
        m = layer._modules
        sandwich = layer.sandwich
        plan.add_layer(
            m["input_layernorm"].weight, m["post_attention_layernorm"].weight,
            m["pre_feedforward_layernorm"].weight if sandwich else None,
            m["post_feedforward_layernorm"].weight if sandwich else None,
            layer.q_norm.weight if layer.q_norm is not None else None,
            layer.k_norm.weight if layer.k_norm is not None else None,
            layer.qkv_bias, layer.rope_id, windows.index(layer.window), float(layer.q_scale), bool(layer.gelu))
        for name, (op, weight, scales, offsets, n, k, bits, group) in per_layer.items():
            plan.set_projection(name, op, weight, scales, offsets, n, k, bits, group)
    return NativeDecodeStep(plan, tables, max_rows, lookup), ""


def _woq_op(activations: str = "int16") -> str | None:
    """The registered name of the weight-only kernel a GroupLinear with these ``activations`` calls
    (the build ``woq.isa()`` loaded)."""
    from sgrt.kernels import woq

    return woq.op_name(activations)
