"""What sgrt's weight-only quantized linear layers share: the quantization names, the kernels'
activation dtype, the row thresholds, and :class:`QuantizedLinear` (packed kernel or dense
matmul by input rows). The layers are in :mod:`sgrt.models.quant_torch` and
:mod:`sgrt.models.quant_native`; :mod:`sgrt.models.quant` explains them and installs them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgrt.errors import InvalidRequest

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32
# The packed kernels' activation and scale dtype (CPU and CUDA).
KERNEL_DTYPE = torch.bfloat16
# Logit rows up to which a tied model's quantized LM head beats its float one (see quantize_model):
# torch's int8 kernel / the native group-wise kernel.
INT8_HEAD_MAX_ROWS = 4
GROUP_HEAD_MAX_ROWS = 32
# Rows from which a quantized layer dequantizes its weight to bfloat16 for one dense matmul
# instead of calling the packed kernel, which is compute-bound there (prefill chunks). Measured
# on the default model's shapes, 2 threads, 512 rows: int8 kernel 2.6x and int4 kernel 2.2x the
# bfloat16 matmul's time, dequantize + matmul 1.2-1.4x.
DENSE_MIN_ROWS = 128


def parse_quantization(quantization: str | None) -> str:
    """``None`` / ``"none"`` / ``"int8"`` / ``"int4"`` (any case) -> the canonical name.

    Raises:
        InvalidRequest: (field ``quantization``) any other value.
    """
    name = "none" if quantization is None else str(quantization).strip().lower()
    if name not in QUANTIZATIONS:
        raise InvalidRequest(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}",
                             field="quantization")
    return name


_CHECKED: set[tuple[str, str]] = set()


def check_kernel(mod: nn.Module, w_ref: torch.Tensor, kind: str) -> None:
    """Once per (kernel, device type) off the CPU, where our tests do not run: compare a small
    matmul with ``w_ref`` ``[N, K]`` float32, and fail loudly rather than serve wrong logits.

    Raises:
        ModelLoadError: the kernel is missing or disagrees (names the kernel and the device).
    """
    from sgrt.errors import ModelLoadError

    device = w_ref.device
    if device.type == "cpu" or (kind, device.type) in _CHECKED:
        return
    x = torch.randn(3, w_ref.shape[1], device=device).to(KERNEL_DTYPE)
    try:
        got = mod(x).float()
    except RuntimeError as e:
        raise ModelLoadError(f"quantization {kind!r}: torch's packed kernel failed on {device}: {e}") from e
    ref = x.float() @ w_ref.t()
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    if not err < 2e-2:
        raise ModelLoadError(f"quantization {kind!r}: torch's packed kernel on {device} is off by "
                             f"{err:.3g} (relative) from the dequantized weights; use quantization='none'")
    _CHECKED.add((kind, device.type))


def as_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == KERNEL_DTYPE else x2.to(KERNEL_DTYPE)


class QuantizedLinear(nn.Module):
    """What int8 and int4 layers share: the choice between the packed kernel (decode-sized
    inputs) and a dense matmul over the dequantized weight (from :data:`DENSE_MIN_ROWS` rows).

    Input ``[..., K]`` of any float dtype; output ``[..., N]`` in the input's dtype.
    """

    out_features: int

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        """The packed kernel on ``[M, K]`` bfloat16 -> ``[M, N]`` bfloat16."""
        raise NotImplementedError

    def _dense_weight(self) -> torch.Tensor | None:
        """``W`` ``[N, K]`` bfloat16 for a dense matmul, or None where it cannot be built."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        own = x.dim() == 2 and x.dtype == KERNEL_DTYPE  # the model's own calls: no reshapes
        x2 = x if own else as_2d(x)
        weight = self._dense_weight() if x2.shape[0] >= DENSE_MIN_ROWS else None
        y = self._kernel(x2) if weight is None else F.linear(x2, weight)
        return y if own else y.view(*x.shape[:-1], self.out_features).to(x.dtype)
