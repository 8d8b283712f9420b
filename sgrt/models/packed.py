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

**Dense kernel** (:class:`DenseLinear`): where oneDNN cannot prepack a dtype on this CPU (bfloat16
without AVX-512 BW or AVX-NE-CONVERT: torch's plain bfloat16 matmul then widens the weights
element by element) and sgrt's AVX2 kernel (:mod:`sgrt.kernels.dense`) loads, the projections and
the LM head run that kernel for decode-sized inputs (up to :data:`DENSE_MAX_ROWS` rows) on the
plain weight (no copy: a tied head reads the embedding table), and ``F.linear`` for more rows.
float32 takes the kernel over oneDNN's prepacked layers too (``DENSE_DTYPES_OVER_ONEDNN``): at
one row oneDNN's float32 matmul measured 1.4-2.3x slower than the kernel on the 2-core AVX2 EPYC
(``bench/dense_kernel.py``), and greedy outputs stayed token-identical (``bench/ab_commits.py
--what tokens``, the float32 model tests against transformers). float32 prefill then runs
``F.linear`` (MKL) instead of oneDNN, and the LM head no longer needs a 113 MB copy.

Where oneDNN does prepack bfloat16 (AVX-512 BF16 / AMX CPUs), its matmul at one row is the slow
part of bfloat16 decode (the 2-core AVX-512 BF16 Xeon: 2-9 GB/s of weights at one row against the
kernel's 15-18; the kernel 1.0-1.4x oneDNN's speed at 4 rows, 0.45-0.8x at 8, 0.25-0.4x at 16,
``bench/dense_kernel.py --rows R``), while oneDNN is what prefill wants there (the kernel's
fallback ``linear_bf16_via_f32`` 3-7x oneDNN's time at 16-512 rows). So bfloat16 projections and
LM head there are a :class:`DenseLinear` *beside* a prepacked copy (``above``): the kernel up to
:data:`DENSE_ROWS_BESIDE_ONEDNN` rows, the copy for more. The price is the plain weights' memory
a second time (SmolLM2-135M: +212 MB; the tied LM head already had its prepacked copy).
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
# Rows of x up to which DenseLinear runs the native kernel: a decode batch. The kernel reads each
# weight once per call but multiplies row by row, so from ~16 rows a blocked matmul is ahead.
DENSE_MAX_ROWS = 16
# The dtypes DenseLinear takes over from oneDNN's prepacked layers where those do pack
# (DENSE_DTYPES_OVER_ONEDNN: float32, whose oneDNN matmul is slower than the kernel at one row)
# and where they do not (DENSE_DTYPES).
DENSE_DTYPES = (torch.float32, torch.bfloat16)
DENSE_DTYPES_OVER_ONEDNN: tuple[torch.dtype, ...] = (torch.float32,)
# Where oneDNN prepacks a dtype of DENSE_DTYPES that is not over it (bfloat16 on AVX-512 BF16 /
# AMX CPUs): the rows DenseLinear's kernel takes, beside a prepacked copy for more (the kernel's
# speed against oneDNN's crosses at ~4 rows there; module docstring).
DENSE_ROWS_BESIDE_ONEDNN = 4


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


# Weight elements converted to float32 at a time by linear_bf16_via_f32 (a 16 MB float32 tile):
# a whole projection in one piece, the LM head (up to 262k x 640 on Gemma 3) in tiles.
F32_TILE_ELEMENTS = 1 << 22


def linear_bf16_via_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for bfloat16 ``x`` ``[..., K]`` and ``weight`` ``[N, K]`` on the CPU, computed
    as a float32 matmul (MKL's SGEMM) over float32 copies of the weight made per call, in tiles of
    up to :data:`F32_TILE_ELEMENTS` elements; result ``[..., N]`` bfloat16 (each output rounded
    once, to nearest even, from its float32 sum, as ``F.linear`` in bfloat16 does; the summation
    order is MKL's, so results can differ from ``F.linear``'s in the last bfloat16 bit).

    Why: without AVX-512 BF16 (or AMX / AVX-NE-CONVERT), torch's bfloat16 matmul widens the
    weights element by element inside its inner loop; widening each weight once per call and
    multiplying in float32 measured 1.7-8x faster on the 2-core AVX2 EPYC from 17 rows up (1
    thread, projection shapes of SmolLM2-135M and Gemma 3 270M: 0.31-0.60x the time at 17 rows,
    0.12-0.17x at 256 and 1,024 rows). The widening (~1 ms per million weights) is amortized
    over the rows, so this serves prefill chunks, not decode (:class:`DenseLinear`'s kernel).
    """
    x32 = x.float()
    n, k = weight.shape
    step = max(16, F32_TILE_ELEMENTS // max(k, 1))
    if step >= n:
        return F.linear(x32, weight.float()).to(torch.bfloat16)
    y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16, device=x.device)
    for i in range(0, n, step):  # (copy_ rounds float32 -> bfloat16 to nearest even)
        y[..., i: i + step].copy_(F.linear(x32, weight[i: i + step].float()))
    return y


class DenseLinear(nn.Module):
    """``y = x @ W.T`` on the plain row-major weight ``W`` ``[N, K]`` (no bias): sgrt's AVX2 kernel
    (:mod:`sgrt.kernels.dense`) for 2-D inputs of up to ``max_rows`` rows; above that (prefill
    chunks) ``above`` if given (a :class:`PackedLinear` of the same weight, where oneDNN prepacks
    its dtype), else :func:`linear_bf16_via_f32` for bfloat16 and ``F.linear`` for float32 (and
    other devices or dtypes).

    Input ``[..., K]``; output ``[..., N]`` in the input's dtype (the weight's, for the kernel).
    The weight is the given tensor itself (a parameter is kept as it is, so a tied LM head shares
    the embedding table); ``above`` is re-packed from it when the weight was changed in place since
    (its version counter). Call after :func:`sgrt.kernels.dense.available` returned True.
    """

    def __init__(self, weight: torch.Tensor, max_rows: int = DENSE_MAX_ROWS, above: "PackedLinear | None" = None):
        super().__init__()
        from sgrt.kernels import dense

        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.register_module("above", above)  # (registered when None too: forward reads _modules)
        # The weight's version counter when `above` was packed: a later in-place change of the
        # weight (load_state_dict, a merged delta) re-packs it before its next use, so that every
        # row count computes with the same weight.
        self._packed_version = self._version_of(self.weight) if above is not None else None
        self._linear = dense.kernel()

    @staticmethod
    def _version_of(w: torch.Tensor) -> int | None:
        try:
            return w._version
        except RuntimeError:  # an inference tensor has no version counter (and cannot change)
            return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._parameters["weight"]  # (self.weight: nn.Module.__getattr__, ~1.5 us, 4 calls a layer)
        if (x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == w.dtype and x.is_cpu and w.is_cpu
                and x.stride(-1) == 1):
            return self._linear(x, w)
        above = self._modules["above"]
        if above is not None and x.dtype == w.dtype:
            if self._version_of(w) != self._packed_version:
                with torch.no_grad():
                    above = self.above = PackedLinear(w.detach())
                self._packed_version = self._version_of(w)
            return above(x)
        if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.is_cpu and w.is_cpu:
            return linear_bf16_via_f32(x, w)
        return F.linear(x, w)

    def extra_repr(self) -> str:
        more = ", oneDNN prepacked copy above" if self._modules["above"] is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"native dense kernel up to {self.max_rows} rows{more}")


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


def _onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN prepacks ``weight``'s dtype on this CPU (tried on a small matrix; cached)."""
    key = (weight.dtype, weight.device.type)
    if key not in _onednn_ok:
        probe = torch.zeros(16, 64, dtype=weight.dtype, device=weight.device)
        try:
            _onednn_ok[key] = can_pack(probe) and torch.ops.mkldnn._reorder_linear_weight(probe, PACK_BATCH_HINT) is not None
        except RuntimeError:
            _onednn_ok[key] = False
    return _onednn_ok[key]


_onednn_ok: dict[tuple[torch.dtype, str], bool] = {}


def dense_kernel_for(weight: torch.Tensor) -> bool:
    """Whether :class:`DenseLinear` serves ``weight``'s decode rows (a CPU float32 / bfloat16
    matrix, its dtype in ``DENSE_DTYPES``) and the native kernel loads (not with
    ``SGRT_NATIVE_KERNELS=0``). Where :func:`beside_onednn` is also true it takes up to
    :data:`DENSE_ROWS_BESIDE_ONEDNN` rows, beside a prepacked copy."""
    if weight.device.type != "cpu" or weight.dtype not in DENSE_DTYPES or weight.dim() != 2:
        return False
    from sgrt.kernels import dense

    return dense.available()


def beside_onednn(weight: torch.Tensor) -> bool:
    """Whether oneDNN prepacks ``weight``'s dtype here and that dtype is not one the kernel takes
    over from it (``DENSE_DTYPES_OVER_ONEDNN``): then a :class:`DenseLinear` of it keeps a
    :class:`PackedLinear` copy for more than :data:`DENSE_ROWS_BESIDE_ONEDNN` rows."""
    return weight.dtype not in DENSE_DTYPES_OVER_ONEDNN and _onednn_packs(weight)


def _dense_or_none(weight: torch.Tensor, what: str, check: bool) -> DenseLinear | None:
    """A :class:`DenseLinear` of ``weight`` (where :func:`dense_kernel_for` is true), with a
    prepacked copy above its rows where :func:`beside_onednn` says so; None if that copy cannot
    be made or (with ``check``) the layer disagrees with ``F.linear`` (logged)."""
    above = None
    if beside_onednn(weight):
        above = _packed_or_none(weight, what, check)
        if above is None:
            return None
    layer = DenseLinear(weight, DENSE_ROWS_BESIDE_ONEDNN if above is not None else DENSE_MAX_ROWS, above)
    if check and not _dense_agrees(layer, weight):
        logger.warning("the dense kernel disagrees with F.linear on %s; keeping torch's layers", what)
        return None
    return layer


def _dense_agrees(layer: DenseLinear, weight: torch.Tensor) -> bool:
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    want = F.linear(x.float(), weight.float())
    got = layer(x).float()
    return bool(((got - want).norm() / want.norm().clamp_min(1e-12)) <= 1e-2)


def pack_linear_layers(model: nn.Module, names: tuple[str, ...]) -> int:
    """Replace each decoder layer's plain ``nn.Linear`` projections named in ``names`` by
    :class:`DenseLinear` where :func:`dense_kernel_for` says so, else by :class:`PackedLinear`,
    in place; returns how many were replaced. Stops at the first layer that cannot be packed
    (:func:`can_pack` depends only on the dtype, the device and this torch) and replaces nothing
    if the first replaced layer disagrees with ``F.linear``."""
    count = 0
    for i, layer in enumerate(model.layers):
        for name in names:
            current = getattr(layer, name)
            if type(current) is not nn.Linear or current.bias is not None:
                continue
            make = _dense_or_none if dense_kernel_for(current.weight) else _packed_or_none
            replacement = make(current.weight, f"layers.{i}.{name}", check=count == 0)
            if replacement is None:
                return count
            setattr(layer, name, replacement)
            count += 1
    return count


def pack_lm_head(model: nn.Module) -> bool:
    """Give an unquantized model (``model.logits_head`` None) a :class:`DenseLinear` over its LM
    head's own weight where :func:`dense_kernel_for` says so (with a prepacked copy above its rows
    where :func:`beside_onednn` does), else a :class:`PackedLinear` copy of it for every batch
    size (an untied model's plain head is then freed); True if done."""
    if model.logits_head is not None:
        return False
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if dense_kernel_for(weight):
        # NOTE: the plain weight itself (a tied one is the embedding table: no copy); more rows
        # than the kernel takes go to the prepacked copy (beside oneDNN), linear_bf16_via_f32
        # (bfloat16, inside the layer) or compute_logits' F.linear on the same tensor (float32).
        head = _dense_or_none(weight, "the LM head", check=True)
        if head is None:
            return False
        model.logits_head = head
        # bfloat16 or a prepacked copy: every row count goes to the layer
        inside = weight.dtype == torch.bfloat16 or head.above is not None
        model.logits_head_max_rows = 1 << 62 if inside else head.max_rows
        return True
    head = _packed_or_none(weight, "the LM head", check=True)
    if head is None:
        return False
    model.logits_head = head
    model.logits_head_max_rows = 1 << 62
    model.lm_head = None
    return True
