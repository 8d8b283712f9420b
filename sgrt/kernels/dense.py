"""Dense float32 / bfloat16 linear layers for decode-sized inputs: sgrt's AVX2 + FMA kernel
(``dense_avx2.cpp``, library ``sgrt_dense_avx2``).

``y = x @ W.T`` with ``W`` ``[N, K]`` in PyTorch's own row-major layout (the model's parameter
itself: nothing is repacked or copied, so a tied LM head reads the embedding table), ``x``
``[M, K]`` with contiguous rows, ``M`` of a decode step (1 to a few dozen rows; any ``M >= 0``
works). A batch-1 decode step is a matrix-vector product bound by reading the weights once, and
on CPUs without AVX-512 torch's paths do not reach that: its bfloat16 matmul widens the weights
element by element (oneDNN's prepacked bfloat16 layout needs AVX-512 BW or AVX-NE-CONVERT), and
its float32 matmul at one row is a BLAS GEMV with per-call overhead.

Arithmetic: fp32 FMAs (bfloat16 weights widened exactly by a 16-bit shift or a mask), two
accumulators a weight row (the halves of each 16-input step), a fixed horizontal sum, one
rounding to the output dtype (nearest even for bfloat16). A row's result does not depend on the
other rows or on the thread count (bitwise). It differs from ``F.linear`` by the order of float32
sums only: for float32, within a few float32 ulps of ``|x| @ |W|.T``; for bfloat16, the fp32 sum
is within that of the exact one and then rounded once (``tests/models/test_dense_kernel.py`` states
and checks the bounds).

The output features are split across torch's intra-op threads (``at::parallel_for``) in
contiguous ranges; each thread reads its range as 4 sequential streams far apart (its 4 equal
parts side by side: one core keeps more cache misses in flight, 1.5-1.8x one stream's GB/s from
DRAM), and each group of 4 weight rows serves every row of ``x`` while it is in L1. The grouping
changes which outputs are computed together, never an output's arithmetic.

Build: compiled on first use (~10 s on 2 cores) and cached by
:func:`sgrt.kernels.build.load_library`; ``SGRT_NATIVE_KERNELS=0`` or a CPU without
``REQUIRED_CPU_FLAGS`` disables it (:func:`available` is then False and callers keep torch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from sgrt.kernels.build import disabled, load_library, operator_entry

SOURCE = Path(__file__).with_name("dense_avx2.cpp")
REQUIRED_CPU_FLAGS = ("avx2", "fma")
CFLAGS = ["-mavx2", "-mfma"]
DTYPES = (torch.float32, torch.bfloat16)

_state: dict[str, Callable] = {}


def available() -> bool:
    """Whether the kernel can run here: an x86-64 CPU with AVX2 and FMA, ``SGRT_NATIVE_KERNELS``
    not ``0``, the library compiled and loaded. Never raises (a warning says why not); cached
    per process except for ``SGRT_NATIVE_KERNELS``."""
    if disabled():
        _state.pop("op", None)
        load_library("sgrt_dense_avx2", SOURCE, CFLAGS, REQUIRED_CPU_FLAGS)  # logs why, once
        return False
    if "op" in _state:
        return True
    if load_library("sgrt_dense_avx2", SOURCE, CFLAGS, REQUIRED_CPU_FLAGS) is not None:
        return False
    _state["op"] = operator_entry(torch.ops.sgrt_dense_avx2.linear.default)
    _register_fake()
    return True


def _register_fake() -> None:
    try:
        torch.library.register_fake("sgrt_dense_avx2::linear")(
            lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))
    except RuntimeError:  # registered already (a second load in this process)
        pass


def kernel() -> Callable:
    """The registered operator's C++ entry, ``(x, weight) -> y``, for callers that checked
    :func:`available` once and call it many times a decode step (no argument checks in Python).

    Raises:
        RuntimeError: :func:`available` is False.
    """
    if not available():
        raise RuntimeError("sgrt.kernels.dense: the native kernel is unavailable (see the log)")
    return _state["op"]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` on the kernel.

    Args:
        x: ``[M, K]`` float32 or bfloat16 on the CPU, ``M >= 0``, rows contiguous (stride 1
            along ``K``; any row stride).
        weight: ``[N, K]``, contiguous, ``N, K >= 1``, the dtype of ``x``.

    Returns:
        ``[M, N]`` in that dtype (fp32 sums; see the module docstring for the rounding).

    Raises:
        sgrt.errors.InvalidRequest: a dtype, device, shape or layout other than the above
            (``field`` names the argument; the message the limit).
        RuntimeError: :func:`available` is False.
    """
    from sgrt.errors import InvalidRequest

    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise InvalidRequest(f"{name} must be a 2-D tensor, got "
                                 f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}", field=name)
        if t.device.type != "cpu":
            raise InvalidRequest(f"{name} must be on the CPU, got {t.device}", field=name)
        if t.dtype not in DTYPES:
            raise InvalidRequest(f"{name} must be float32 or bfloat16, got {t.dtype}", field=name)
    if x.dtype != weight.dtype:
        raise InvalidRequest(f"x must have weight's dtype {weight.dtype}, got {x.dtype}", field="x")
    n, k = weight.shape
    if n == 0 or k == 0 or not weight.is_contiguous():
        raise InvalidRequest(f"weight must be contiguous with N, K >= 1, got shape {tuple(weight.shape)}, "
                             f"strides {weight.stride()}", field="weight")
    if x.shape[1] != k:
        raise InvalidRequest(f"x must be [M, K={k}], got {tuple(x.shape)}", field="x")
    if x.shape[0] and k > 1 and x.stride(1) != 1:
        raise InvalidRequest(f"x's rows must be contiguous (stride 1 along K), got strides {x.stride()}",
                             field="x")
    return kernel()(x, weight)
