"""Weight-only int8 / int4 linear layers, and the pass that installs them.

Batch-1 decode is bound by reading the weights, so storing them in 8 or 4 bits and dequantizing
inside the matmul kernel is where the speed comes from. Activations stay bfloat16.

Two kernel families; :func:`quantize_model` takes the first that runs here:

1. **sgrt's native CPU kernel** (:class:`GroupLinear`, :mod:`sgrt.kernels.woq`; AVX-512 BF16
   CPUs, or its AVX2 + FMA build elsewhere; compiled on first use): ``W[n, k] = scale[n, g] * code[n, k] + offset[n, g]`` per group
   of 32 inputs, float16 scale and offset, float32 sums.

   - **int4**: a GGUF's Q4_1 tensors as they are (codes, ``d``, ``m``: the file's weights bit
     for bit, see :mod:`sgrt.models.gguf_raw`); anything else quantized at load, min/max per
     group (:func:`quantize_groups`).
   - **int8**: quantized at load the same way with 8-bit codes (Q4_1's asymmetric form with 256
     levels). Per group rather than per channel: on the default model, whose weights are 4-bit
     groups, a per-channel grid (one step of ``max|row| / 127``) re-rounds them and top-1
     agreement with bfloat16 falls to 94-96%; per group it is 97.5% (teacher-forced, 200 tokens).

2. **torch's packed kernels** (CUDA, and CPUs without AVX-512 BF16 or AVX2):

   - **int8** (:class:`Int8Linear`): per-output-channel symmetric, ``scale[n] = max|W[n, :]| /
     127``, ``q = round(W / scale)`` in -127..127, ``y = (x @ q.T) * scale``
     (``torch.ops.aten._weight_int8pack_mm``).
   - **int4** (:class:`Int4Linear`): Q4_1 groups of 32 on torch's kernels
     (``_weight_int4pack_mm_for_cpu`` / ``_weight_int4pack_mm`` on CUDA, "tinygemm"), which
     compute ``(q - 8) * scale + zero``: a Q4_1 block maps to ``scale = d``, ``zero = m + 8 d``.
     The fast kernels want bfloat16 scales and zeros (float32 ones only with float32
     activations, 40-50x slower on this CPU: measured), so these are the file's values rounded
     to bfloat16 (relative error at most 2**-8; checked in ``tests/models/test_quantization.py``).

**LM head**: its own quantized copy, int8 in both modes unless the file stores the head in Q4_1
(the tied embedding stays a float lookup table for the input side). Measured on the default
model (tied Q8_0 embedding), teacher-forced over 200 tokens: an int4 head quantized at load drops
top-1 agreement with bfloat16 to 84-90% (mean KL ~0.06), an int8 head keeps 96-98.5%. A tied
model uses it for logit batches of up to :data:`GROUP_HEAD_MAX_ROWS` rows (native) or
:data:`INT8_HEAD_MAX_ROWS` (torch's int8 kernel, compute-bound past a few rows) and its float
embedding table past that; so logits may differ in the last bits with the batch size, as they
do across dtypes.

Layers whose shapes a kernel cannot take keep their float weights (native: ``out % 16``,
``in % 32``; torch's CPU int4 the same; its int8: ``in % 16``, as the CPU kernel crashes the
process on other widths). A model whose dtype is not bfloat16 still works: each quantized layer
casts its input to bfloat16 and its output back (use ``dtype="bfloat16"`` with quantization).

Speed (2 threads, the default model's 120 projections, ms a pass; ``bench/woq_kernel.py``): at
1 row native int4 3.4, int8 6.0, torch's int4 4.0, int8 8.3, bfloat16 (oneDNN) 13.6; at 16 rows
10.7 / 11.4 / 21.8 / 33.5 / 17.1. torch's kernels are compute-bound from a few rows and 2-4x
slower than bfloat16 on prefill chunks, so from :data:`DENSE_MIN_ROWS` rows their layers
dequantize the weight to bfloat16 (int4: unpacked from the CPU kernel's own layout, no second
copy kept) for one dense matmul; the native kernel stays within 1.3x of bfloat16 there and
always runs. The CUDA paths are written to torch's documented layouts but untested here: the
first layer of each kind is checked against its dequantized weights at load.

The shared base is in :mod:`sgrt.models.quant_base`, the torch-kernel layers in
:mod:`sgrt.models.quant_torch`, the native-kernel layer in :mod:`sgrt.models.quant_native`; this
module installs them (every name re-exported here).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from sgrt.models.quant_base import (  # noqa: F401 - re-exported
    DENSE_MIN_ROWS, GROUP_HEAD_MAX_ROWS, INT4_GROUP_SIZE, INT8_HEAD_MAX_ROWS, KERNEL_DTYPE, QUANTIZATIONS,
    QuantizedLinear, parse_quantization,
)
from sgrt.models.quant_native import GroupLinear, quantize_groups  # noqa: F401 - re-exported
from sgrt.models.quant_torch import (  # noqa: F401 - re-exported
    Int4Linear, Int8Linear, q4_1_scales_and_zeros, quantize_int4, quantize_int8, unpack_int4_cpu,
)

logger = logging.getLogger("sgrt.models")


# ---- installing them ----------------------------------------------------------------------------

def native_kernel_available() -> bool:
    """Whether sgrt's group-wise CPU kernel (:mod:`sgrt.kernels.woq`) runs here (compiles on the
    first call; False on CPUs with neither AVX-512 BF16 nor AVX2 + FMA, with
    ``SGRT_NATIVE_KERNELS=0``, or if the build fails)."""
    from sgrt.kernels import woq

    return woq.available()


def check_int4_activations(activations: str, method: str, device: torch.device) -> None:
    """Raises InvalidRequest (field ``int4_activations``) where ``activations`` cannot apply."""
    from sgrt.errors import InvalidRequest
    from sgrt.kernels import woq

    if activations not in woq.ACTIVATIONS:
        raise InvalidRequest(f"int4_activations must be one of {', '.join(woq.ACTIVATIONS)}, got {activations!r}",
                             field="int4_activations")
    if activations != "int16":
        if method != "int4":
            raise InvalidRequest(f"int4_activations={activations!r} applies to quantization='int4', got {method!r}",
                                 field="int4_activations")
        if device.type != "cpu" or not native_kernel_available() or woq.isa() != "avx2":
            raise InvalidRequest(f"int4_activations={activations!r} needs sgrt's AVX2 int4 kernel (a CPU with AVX2 + FMA "
                                 f"and SGRT_WOQ_ISA not avx512_bf16; this one runs {woq.isa() or 'no native kernel'})",
                                 field="int4_activations")


def quantize_model(model: Any, method: str, weights: dict[str, torch.Tensor],
                   q4_1: dict[str, Any] | None = None, wide: frozenset[str] = frozenset(),
                   int4_activations: str = "int16", q8: dict[str, Any] | None = None) -> dict[str, int]:
    """Replace every fused projection of ``model`` (a :class:`sgrt.models.llama.LlamaForCausalLM`)
    and its LM head by quantized layers, in place.

    Args:
        method: ``"int8"`` or ``"int4"`` (``"none"`` does nothing).
        weights: the float checkpoint, HF names (``model.`` prefix optional): quantizing from it
            rather than from the model's (maybe bfloat16) parameters keeps one rounding, not two.
        q4_1: for int4, Q4_1 blocks (and Q4_K ones in Q4_1's form) by HF name
            (:func:`sgrt.models.gguf_raw.read_q4_1`); a fused projection whose parts are all there
            is built from them as they are.
        wide: for int4, HF names whose source holds more precision than int4 (a GGUF's Q5_0, Q6_K,
            Q8_0, ... tensors: :func:`sgrt.models.gguf_raw.wider_than_4_bits`); a fused projection
            with such a part is built in int8 instead, so that int4 never drops below the file.
        int4_activations: ``"int16"`` (default), ``"int8"`` or ``"int8-prefill"``: the activation
            precision of the int4 projections on the AVX2 kernel
            (:func:`sgrt.kernels.woq.check_activations`; ``"int8"`` is llama.cpp's Q8 blocks:
            faster, less accurate, docs/DESIGN.md; ``"int8-prefill"`` only for calls of many
            rows). The LM head and int8 projections keep ``"int16"``.
        q8: ``Q8_0`` / ``Q5_0`` blocks by HF name (:func:`sgrt.models.gguf_raw.read_q8_groups`); an
            int8 projection (int8 mode, a ``wide`` one in int4 mode, the LM head) whose parts are all
            there is built from them as they are (codes, ``d``, offset ``-c * d``: the file's weights
            exactly, and the native kernel's compact stream), not re-quantized from float.

    Returns:
        Counts: ``{"q4_1": layers loaded from Q4_1 / Q4_K blocks, "q8": int8 layers loaded from Q8_0 /
        Q5_0 blocks, "quantized": layers quantized at load,
        "int8_wide": of those, int4-mode layers built in int8 for a ``wide`` part, "float": layers
        left in float because the kernel cannot take their shape}``. The LM head
        is int8 in int4 mode too, unless the file holds it in Q4_1.

    Raises:
        InvalidRequest: an unknown ``method``; ``int4_activations`` not one of the names above, or
            ``"int8"`` without ``method="int4"`` on the AVX2 kernel.
    """
    from sgrt.models.llama import FUSED_PROJECTIONS

    method = parse_quantization(method)
    check_int4_activations(int4_activations, method, model.device)
    counts = {"q4_1": 0, "q8": 0, "quantized": 0, "int8_wide": 0, "float": 0}
    if method == "none":
        return counts
    sd = {k.removeprefix("model."): v for k, v in weights.items()}
    blocks = {k.removeprefix("model."): v for k, v in (q4_1 or {}).items()} if method == "int4" else {}
    wide_parts = {k.removeprefix("model.") for k in wide} if method == "int4" else set()
    q8_blocks = {k.removeprefix("model."): v for k, v in (q8 or {}).items()}
    device = model.device

    native = device.type == "cpu" and native_kernel_available()

    def build(names: list[str], current: nn.Module | None, kind: str,
              acts: str = int4_activations) -> nn.Module | None:
        widened = kind == "int4" and any(n in wide_parts for n in names)
        if widened:  # a part finer than int4 in the file: keep its precision (int8)
            kind = "int8"
        bits = 8 if kind == "int8" else 4
        if all(n in blocks for n in names):
            from sgrt.models.gguf_raw import Q4_1Weight

            b = Q4_1Weight.cat([blocks[n] for n in names])
            if native and GroupLinear.supports(*b.shape, device):
                counts["q4_1"] += 1
                return GroupLinear.from_q4_1(b.codes, b.d, b.m, activations=acts)
            if Int4Linear.supports(*b.shape, device):
                counts["q4_1"] += 1
                return Int4Linear.from_q4_1(b.codes, b.d, b.m, device)
        if kind == "int8" and native and names and all(n in q8_blocks for n in names):
            from sgrt.models.gguf_raw import SymmetricWeight

            b = SymmetricWeight.cat([q8_blocks[n] for n in names])
            m = b.m
            if GroupLinear.supports(*b.shape, device) and bool(torch.isfinite(m).all()):
                counts["q8"] += 1
                counts["int8_wide"] += widened
                return GroupLinear(b.codes, b.d, m, 8, INT4_GROUP_SIZE)
        w = torch.cat([sd[n] for n in names]) if len(names) > 1 else sd[names[0]]
        cls = GroupLinear if native else (Int8Linear if kind == "int8" else Int4Linear)
        if cls.supports(*w.shape, device):
            try:
                if native:
                    layer = GroupLinear.from_float(w, bits, activations=acts if bits == 4 else "int16")
                else:
                    layer = cls.from_float(w, device)
            except ValueError as e:  # float16 scales cannot hold this weight
                logger.warning("%s: %s kept in float (%s)", method, "+".join(names), e)
            else:
                counts["quantized"] += 1
                counts["int8_wide"] += widened
                return layer
        else:
            logger.warning("%s: %s kept in float (shape %s not supported by the %s kernel)",
                           method, "+".join(names), tuple(w.shape), kind)
        counts["float"] += 1
        return current

    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for fused, parts in FUSED_PROJECTIONS.items():
                setattr(layer, fused, build([f"layers.{i}.{p}" for p in parts], getattr(layer, fused), method))
        head = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
        # NOTE: the LM head is int4 only when the file stores it in Q4_1; otherwise int8. An int4
        # head quantized at load cuts top-1 agreement with bfloat16 to ~85% on the default model
        # (whose tied embedding is Q8_0), against ~97% with an int8 head (see the module docstring).
        model.logits_head = build([head], None, "int4" if head in blocks else "int8", "int16")
        if model.lm_head is None and isinstance(model.logits_head, Int8Linear):
            # NOTE: the int8 kernel is compute-bound past a few rows (CPU, 1 thread, 49152 x 576:
            # 4.9 ms at 1 row vs 10.5 bfloat16; 7.4 vs 10.6 at 4; 35 vs 13 at 16), and a tied model
            # keeps its float embedding table anyway: larger batches use that as the head.
            model.logits_head_max_rows = INT8_HEAD_MAX_ROWS
        elif model.lm_head is None and isinstance(model.logits_head, GroupLinear):
            # NOTE: the native kernel stays ahead of bfloat16 further (2 threads, the default
            # model's layers: 0.6x bfloat16's time at 16 rows, 0.75x at 32, 0.9x at 64).
            model.logits_head_max_rows = GROUP_HEAD_MAX_ROWS
        if model.lm_head is not None and model.logits_head is not None:
            model.lm_head = None  # NOTE: its float copy is no longer used; free it.
    model.quantization = method
    return counts


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and persistent buffers (packed weights, scales): what its
    weights occupy, the input embedding table included; rotary tables and the like excluded."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for mod in model.modules():
        for name, buf in mod.named_buffers(recurse=False):
            if name not in mod._non_persistent_buffers_set:
                total += buf.numel() * buf.element_size()
    return total
