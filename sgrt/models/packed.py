"""Float linear layers on oneDNN's prepacked weights (CPU).

``F.linear`` on CPU hands a weight in PyTorch's plain row-major layout to the BLAS for every call.
oneDNN (the CPU library torch ships as ``mkldnn``) can instead keep the weight in the blocked
layout its matmul kernels read, reordered once at load: ``torch.ops.mkldnn._reorder_linear_weight``
and ``torch.ops.mkldnn._linear_pointwise``, the pair that Inductor's CPU "freezing" pass uses.
Measured on the default model's projection shapes, 2 threads, all 30 layers per call:

=========  ==========  ==========  ==========  ===========
dtype      1 row       4 rows      16 rows     512 rows
=========  ==========  ==========  ==========  ===========
float32    46 -> 26 ms 65 -> 23 ms 80 -> 33 ms 910 -> 690 ms
bfloat16   19 -> 16 ms 21 -> 15 ms 29 -> 20 ms 356 -> 340 ms
=========  ==========  ==========  ==========  ===========

bfloat16 results are bit-identical to ``F.linear``; float32 ones differ by float32 rounding
(another summation order; relative differences around 1e-6).

The LM head gains the most where it scores several rows (a speculative or jump-forward verify,
a decode batch): on the default model in float32, scoring 2 rows with ``F.linear`` took ~12 ms
more than 1 row. :func:`pack_lm_head` gives an unquantized model a packed copy of its head;
a tied model keeps its embedding table for the input lookup, so that copy costs the table's
size again (57 MB in bfloat16, 113 MB in float32 on the default model).

The packed weight is an opaque mkldnn tensor of the same size, held as the parameter
``packed`` (so ``parameters()`` still counts it; ``state_dict()`` holds it in the mkldnn
layout); :attr:`PackedLinear.weight` unpacks a dense copy for inspection. Layers stay as they are where oneDNN is missing, on other
devices and dtypes, or if the packed result disagrees with ``F.linear`` at load.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("sgrt.models")

# The batch size oneDNN picks the blocked layout for; any number of rows works with it.
# 16 (a decode batch) measured as good as 1 at one row and better at 4-512 rows.
PACK_BATCH_HINT = 16
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``y = x @ W.T`` with ``W`` ``[N, K]`` held in oneDNN's blocked layout (no bias).

    Input ``[..., K]`` in the weight's dtype; output ``[..., N]`` in the same dtype.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A parameter (not a buffer) so that parameters() and state_dict() still hold the weight.
        self.packed = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT),
                                   requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight ``[N, K]`` (not the storage the layer computes with)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked"


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this process can prepack ``weight`` (CPU, float32 / bfloat16, oneDNN present)."""
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _agrees(layer: PackedLinear, weight: torch.Tensor) -> bool:
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    want = F.linear(x, weight).float()
    got = layer(x).float()
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return bool(((got - want).norm() / want.norm().clamp_min(1e-12)) <= tol)


def _packed_or_none(weight: torch.Tensor, what: str, check: bool) -> PackedLinear | None:
    """A :class:`PackedLinear` of ``weight``, or None where :func:`can_pack` says no, packing
    fails, or (with ``check``) its result disagrees with ``F.linear`` (both logged)."""
    if not can_pack(weight):
        return None
    with torch.no_grad():
        try:
            layer = PackedLinear(weight)
        except RuntimeError as e:
            logger.warning("oneDNN prepacking of %s failed (%s); keeping it plain", what, e)
            return None
        if check and not _agrees(layer, weight):
            logger.warning("oneDNN prepacked %s disagrees with F.linear; keeping it plain", what)
            return None
    return layer


def pack_linear_layers(model: nn.Module, names: tuple[str, ...]) -> int:
    """Replace each decoder layer's plain ``nn.Linear`` projections named in ``names`` by
    :class:`PackedLinear`, in place; returns how many were packed. Stops at the first layer that
    cannot be packed (:func:`can_pack` depends only on the dtype, the device and this torch) and
    packs nothing if the first packed layer disagrees with ``F.linear``."""
    count = 0
    for i, layer in enumerate(model.layers):
        for name in names:
            current = getattr(layer, name)
            if type(current) is not nn.Linear or current.bias is not None:
                continue
            packed = _packed_or_none(current.weight, f"layers.{i}.{name}", check=count == 0)
            if packed is None:
                return count
            setattr(layer, name, packed)
            count += 1
    return count


def pack_lm_head(model: nn.Module) -> bool:
    """Give an unquantized model (``model.logits_head`` None) a :class:`PackedLinear` copy of its
    LM head for every batch size; True if done. An untied model's plain head is then freed."""
    if model.logits_head is not None:
        return False
    head = _packed_or_none(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight,
                           "the LM head", check=True)
    if head is None:
        return False
    model.logits_head = head
    model.logits_head_max_rows = 1 << 62
    model.lm_head = None
    return True
