"""Weight-only int8 / int4 linear layers, and the pass that installs them.

Batch-1 decode is bound by reading the weights, so storing them in 8 or 4 bits and dequantizing
inside the matmul kernel is where the speed comes from. Activations stay bfloat16.

Two kernel families; the weight packer (:mod:`sgrt.models.weight_packer`, which chooses each
weight's form and writes it into the store a load maps) takes the first that runs here:

1. **sgrt's native CPU kernel** (:class:`GroupLinear`, :mod:`sgrt.kernels.woq`; AVX-512 BF16
   CPUs, or its AVX2 + FMA build elsewhere; compiled on first use): ``W[n, k] = scale[n, g] * code[n, k] + offset[n, g]`` per group
   of 32 inputs, float16 scale and offset, float32 sums.

   - **int4**: a GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) as they are (codes, ``d``, ``m``: the
     file's weights, see :mod:`sgrt.models.gguf_raw`); its finer blocks in int8 (below);
     anything else quantized at load, min/max per group (:func:`quantize_groups`).
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

**LM head**: its own quantized copy, int8 in both modes unless the file stores the head in 4-bit
blocks. Measured on the default model (tied Q8_0 embedding), teacher-forced over 200 tokens: an
int4 head quantized at load drops top-1 agreement with bfloat16 to 84-90% (mean KL ~0.06), an
int8 head keeps 96-98.5%. Where that head holds the file's own blocks (a GGUF's Q8_0 / Q5_0 / 4-bit
table) the input embedding reads its rows from them (:class:`GroupEmbedding`: the same values a
float table converted from the file has), and an untied model's embedding likewise from its own
blocks; so no float table is kept and the quantized head scores every batch. Otherwise (an HF
checkpoint, a table in Q6_K, torch's kernels) the input side stays a float table in the model's
dtype, and a tied model uses the quantized head for logit batches of up to
:data:`GROUP_HEAD_MAX_ROWS` rows (native) or :data:`INT8_HEAD_MAX_ROWS` (torch's int8 kernel,
compute-bound past a few rows) and that table past them; so logits may differ in the last bits
with the batch size, as they do across dtypes.

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
:mod:`sgrt.models.quant_torch`, the native-kernel layer in :mod:`sgrt.models.quant_native`
(every name re-exported here); :mod:`sgrt.models.assemble` builds them over a store's tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from sgrt.models.quant_base import (  # noqa: F401 - re-exported
    DENSE_MIN_ROWS, GROUP_HEAD_MAX_ROWS, INT4_GROUP_SIZE, INT8_HEAD_MAX_ROWS, KERNEL_DTYPE, QUANTIZATIONS,
    QuantizedLinear, parse_quantization,
)
from sgrt.models.quant_native import GroupEmbedding, GroupLinear, quantize_groups  # noqa: F401 - re-exported
from sgrt.models.quant_torch import (  # noqa: F401 - re-exported
    Int4Linear, Int8Linear, q4_1_scales_and_zeros, quantize_int4, quantize_int8, unpack_int4_cpu,
)

# ---- which kernels run here ------------------------------------------------------------------------

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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and persistent buffers (packed weights, scales): what its
    weights occupy, the input embedding table included; rotary tables and the like excluded."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for mod in model.modules():
        for name, buf in mod.named_buffers(recurse=False):
            if name not in mod._non_persistent_buffers_set:
                total += buf.numel() * buf.element_size()
    return total
