"""What form each weight of a model is packed in, for a target (dtype, quantization, kernel layout).

:func:`choose_form` gives each fused projection, the LM head and the input embedding a *form*,
from the quantization, the kernels that run here and the file's tensor types (the rules the int4
/ int8 modes have always followed, :mod:`sgrt.models.quant`):

- ``"dense"``: the weight in the model's dtype (no quantization; or a shape no kernel takes);
- ``"group"``: sgrt's native kernel (:mod:`sgrt.kernels.woq`): 4- or 8-bit codes with a float16
  scale and offset per 32 inputs, laid out as the loaded build reads them (the AVX2 build's one
  stream per weight, ``woq.fuse`` / ``woq.fuse5``; the AVX-512 BF16 build's ``woq.pack``-ed codes
  beside the scales and offsets). Its ``source`` says where the codes come from: ``"blocks"``, a
  GGUF's own codes (:data:`sgrt.models.gguf_raw.BLOCK_READERS`: Q4_0 / Q4_1 / Q4_K as 4-bit,
  Q5_0 / Q5_1 / Q5_K / Q8_0 as 8-bit; no float round trip), or ``"float"``, quantized from the
  rows by min / max (``quantize_groups``; HF checkpoints, and GGUF types without that form such as
  Q6_K, dequantized a chunk at a time). ``kq``: an int4 projection whose parts are all ``Q4_K``,
  on the AVX2 build, held as the file's super-blocks (``woq.fuse_kq4``: float16 ``d`` / ``dmin``
  and 6-bit scales / mins per 256 inputs, 4.625 bits a weight; exact) instead of a float16 scale
  and offset per 32 (5 bits, the products rounded); not the LM head, whose table a tied embedding
  reads (``woq.gather_rows`` takes the per-group form);
- ``"int8_torch"`` / ``"int4_torch"``: torch's packed kernels where the native one does not run
  (CUDA; CPUs without AVX2): their codes and scales, device-packed at load.

The packer (:mod:`sgrt.models.weight_packer`) writes each weight in its form;
:mod:`sgrt.models.assemble` builds the layers over them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sgrt.models import gguf_raw

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Bump when what a store holds for a target changes (its folder name carries it: old ones are not read).
PACK_VERSION = 2  # (2: Q4_K projections as K-quant streams, Form.kq)


@dataclass(frozen=True)
class Target:
    """What a store is packed for: the model's dtype, its quantization and the kernel layout.

    Attributes:
        dtype: the model's parameter / activation dtype.
        quantization: ``"none"``, ``"int8"`` or ``"int4"``.
        layout: ``"plain"`` (no quantization), ``"avx2"`` / ``"avx2-5bit"`` (the AVX2 build's
            streams; with 5-bit streams for codes below 32 where the CPU reads them),
            ``"avx512-bf16"`` (the opt-in AVX-512 BF16 build) or ``"torch-cpu"`` / ``"torch-cuda"``
            (torch's kernels, whose packing is the device's).
    """

    dtype: torch.dtype
    quantization: str
    layout: str

    @property
    def key(self) -> str:
        """The store's folder name under its checkpoint's cache entry."""
        return f"{DTYPE_NAMES[self.dtype]}-{self.quantization}-{self.layout}-v{PACK_VERSION}"

    @property
    def native(self) -> bool:
        return self.layout in ("avx2", "avx2-5bit", "avx512-bf16")


def target_for(dtype: torch.dtype, quantization: str, device: torch.device) -> Target:
    """The target a load of this dtype and quantization on ``device`` runs (the native kernel's
    build and its 5-bit streams are read off this machine: :mod:`sgrt.kernels.woq`)."""
    from sgrt.kernels import woq
    from sgrt.models import quant

    if quantization == "none":
        return Target(dtype, quantization, "plain")
    if device.type == "cpu" and quant.native_kernel_available():
        if woq.isa() == "avx2":
            return Target(dtype, quantization, "avx2-5bit" if woq.five_bit_streams() else "avx2")
        return Target(dtype, quantization, "avx512-bf16")
    return Target(dtype, quantization, f"torch-{device.type}")


@dataclass
class Form:
    """How one weight is packed (module docstring); stored in the manifest as a dict.

    Attributes:
        form: ``"dense"``, ``"group"``, ``"int8_torch"`` or ``"int4_torch"``.
        rows, cols: the weight's shape. bits: 4 or 8 (quantized forms).
        source: ``"blocks"`` (the file's codes) or ``"float"`` (quantized from the values).
        c: the codes' symmetric zero where every offset is ``-c * scale`` (``Q8_0``: 128,
            ``Q5_0``: 16; the AVX2 build's compact stream), else 0.
        five: the AVX2 build's 5-bit stream of codes below 32 beside the 8-bit one.
        wide: an int4-mode weight kept in int8 because the file holds it in more than 4 bits.
        stream_bits: the kernel's ``bits`` argument (``"group"`` on the AVX2 build).
        kq: the AVX2 build's K-quant stream of ``Q4_K`` super-blocks (module docstring; 4-bit,
            ``stream_bits`` ``woq.KQ4_BITS``).
    """

    form: str
    rows: int
    cols: int
    bits: int = 0
    source: str = "float"
    c: int = 0
    five: bool = False
    wide: bool = False
    stream_bits: int = 0
    kq: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def choose_form(types: list[str], rows: int, cols: int, method: str, target: Target, gguf: bool,
                head: bool = False) -> Form:
    """The form of one fused weight of ``rows`` x ``cols`` whose parts are stored as ``types``
    (GGML type names, or float ones; module docstring). ``method``: the quantization; ``gguf``:
    the types are a GGUF's (its blocks can be taken as they are; int4 keeps its finer ones in
    int8); ``head``: the LM head, int8 unless the file holds it in 4-bit blocks (an int4 head
    quantized at load cost ~10 points of top-1 agreement on the default model:
    :mod:`sgrt.models.quant`)."""
    from sgrt.models.quant import GroupLinear, Int4Linear, Int8Linear

    readers = [gguf_raw.BLOCK_READERS.get(t) for t in types] if gguf else [None] * len(types)
    if method == "none":
        return Form("dense", rows, cols)
    device = torch.device(target.layout.removeprefix("torch-") if target.layout.startswith("torch-") else "cpu")
    four = all(r is not None and r.bits == 4 for r in readers)
    kind = ("int4" if four and method == "int4" else "int8") if head else method
    wide = kind == "int4" and gguf and any(gguf_raw.wider_than_4_bits(t) for t in types)
    if wide:  # a part finer than int4 in the file: keep its precision (int8)
        kind = "int8"
    bits = 8 if kind == "int8" else 4
    if kind == "int4" and four:
        if target.native and GroupLinear.supports(rows, cols, torch.device("cpu")):
            kq = (not head and target.layout in ("avx2", "avx2-5bit") and cols % gguf_raw.Q4_K_SUPER == 0
                  and all(t == "Q4_K" for t in types))
            return Form("group", rows, cols, 4, "blocks", kq=kq)
        if Int4Linear.supports(rows, cols, device):
            return Form("int4_torch", rows, cols, 4, "blocks")
    # (8-bit codes hold a 4-bit part exactly too: an int4-mode projection widened by its finer parts
    # keeps its 4-bit ones as they are; int8 mode re-quantizes 4-bit files, as it always has)
    widths = (4, 8) if wide else (8,)
    if kind == "int8" and target.native and all(r is not None and r.bits in widths for r in readers) \
            and GroupLinear.supports(rows, cols, torch.device("cpu")):
        zeros = {_symmetric_zero(t) for t in types}
        if 0 in zeros:
            c = 0  # (an asymmetric part: every group keeps its offset, codes as they are)
        else:
            c = zeros.pop() if len(zeros) == 1 else 128  # (SymmetricWeight.cat's shift to 128)
        unshifted = c == 0 or all(_symmetric_zero(t) == c for t in types)
        five = target.layout == "avx2-5bit" and unshifted and all(
            gguf_raw.BLOCK_READERS[t].max_code <= 31 for t in types)
        return Form("group", rows, cols, 8, "blocks", c, five, wide)
    if target.native:
        if GroupLinear.supports(rows, cols, torch.device("cpu")):
            return Form("group", rows, cols, bits, "float", wide=wide)
    elif (Int8Linear if kind == "int8" else Int4Linear).supports(rows, cols, device):
        return Form(f"{kind}_torch", rows, cols, bits, "float", wide=wide)
    return Form("dense", rows, cols)


def _symmetric_zero(kind: str) -> int:
    """The symmetric zero ``c`` of a GGML type's codes (``Q8_0``: 128, ``Q5_0``: 16), 0 for the
    asymmetric ones."""
    return {"Q8_0": 128, "Q5_0": 16}.get(kind, 0)
