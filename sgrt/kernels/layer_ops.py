"""Fused CPU operators for a decoder layer's non-matmul work (``layer_ops_cpu/``: the library
``sgrt_layer``, one C++ file per concern, ``register.cpp`` lists them).

A decode step of a small model on a CPU spends as much time dispatching small eager ops as in
its matmuls: RMSNorm is 6 ops, the rotary embedding 7, attention over the KV pool (gather keys
and values, SDPA) 6 more, each a few microseconds whatever its size. These operators do each
step in one call, with the eager code's rounding points (values in float32, rounded to the
tensor's dtype where the eager ops round), so they agree with it up to the order of float32
sums: bit-identical in bfloat16 for the elementwise ops in our tests, within a few float32
ulps in float32.

- ``rms_norm(x, weight, eps)`` / ``add_rms_norm_(x, delta, weight, eps)``: HF Llama RMSNorm
  (Zhang & Sennrich, arXiv:1910.07467), the second after ``x += delta`` in place.
- ``rotary_(qk, cos, sin)``: HF's rotate-half rotary embedding (Su et al., arXiv:2104.09864), in
  place on ``[T, heads, head_dim]``.
- ``rotary_heads_(qkv, cos, sin, heads)``: the same on the first ``heads`` heads of the QKV
  projection's output ``[T, q + k + v heads, head_dim]`` (q and k), v untouched.
- ``qk_norm_(qkv, q_weight, k_weight, n_heads, eps)``: the per-head RMSNorm of q and k (Qwen3,
  Gemma 3) in place on the QKV projection's output ``[T, q + k + v heads, head_dim]``, each head
  as ``rms_norm`` does a row, v untouched.
- ``silu_mul(gate_up)``: SwiGLU's ``silu(gate) * up`` (Shazeer, arXiv:2002.05202).
- ``gelu_tanh_mul(gate_up)``: GeGLU's ``gelu_tanh(gate) * up`` (Gemma's MLP; the same paper), as
  ``F.gelu(gate, approximate="tanh") * up`` (its tanh as ``1 - 2 / (1 + exp(2u))``).
- ``store_kv_(k_cache, v_cache, slots, k, v)``: the new tokens' keys and values into their pool
  slots (what two ``index_copy_`` calls do).
- ``decode_attention(q, k_cache, v_cache, slots, kv_lens)``: one-query softmax attention
  straight from the KV pool's slots, no gathered copy (grouped-query heads read each key once).
- ``decode_attention_qkv_(qkv, cos, sin, n_heads, q_scale, k_cache, v_cache, new_slots, slots,
  kv_lens)``: a decode layer's whole attention block from the QKV output ``[B, q + k + v heads,
  head_dim]``: ``rotary_heads_``, q's pre-scale, ``store_kv_`` and ``decode_attention`` in one call.
- ``extend_attention(q, k_cache, v_cache, slots, kv_lens, q_lens)``: causal softmax attention of
  rows of several new queries (a prefill chunk after a cached prefix), straight from the KV pool's
  slots; bfloat16 only, on CPUs with AVX-512 BF16 (:func:`extend_attention_available`), with the
  rounding points of torch's CPU flash attention (float32 scores and softmax, the weights rounded
  to bfloat16 for the product with V) and its own order of sums, so within bfloat16 rounding of
  SDPA, not bitwise.

Operators take float32 or bfloat16 CPU tensors; they are registered as ``torch.ops.sgrt_layer``
with fake implementations, so ``torch.compile`` treats them as opaque calls.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import torch

from sgrt.kernels.build import load_library, operator_entry

SOURCE_DIR = Path(__file__).with_name("layer_ops_cpu")
# The library's translation units and its own headers (sgrt/kernels/build.py compiles the one and
# keys its cache on both).
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
HEADERS = sorted(SOURCE_DIR.glob("*.h"))
# -ffp-contract=off: no fused multiply-add where the eager code rounds between the two.
# -fno-trapping-math: lets GCC turn the kernels' branches (clamps, NaN checks) into selects, so
# that their loops vectorize (silu_mul: 4x faster); values are unchanged, only the FP exception
# flags, which nothing reads, may differ (torch builds its own kernels with it too).
CFLAGS = ["-march=native", "-ffp-contract=off", "-fno-trapping-math"]
DTYPES = (torch.float32, torch.bfloat16)

_fakes_lock = threading.Lock()
_fakes_registered = False


def available() -> bool:
    """Whether ``torch.ops.sgrt_layer`` is loaded (compiles on the first call; never raises)."""
    global _fakes_registered
    ok = load_library("sgrt_layer", SOURCES, CFLAGS, headers=HEADERS) is None
    if ok and not _fakes_registered:
        with _fakes_lock:
            if not _fakes_registered:
                _register_fakes()
                _fakes_registered = True
    return ok


_extend_supported: bool | None = None

# head_dim values extend_attention takes (the kernel is unrolled over each).
EXTEND_HEAD_DIMS = (64, 128, 256)


def extend_attention_available() -> bool:
    """Whether ``extend_attention`` can run here: the library loads and was compiled for a CPU
    with AVX-512 BF16 (``extend_attention_supported``; elsewhere callers keep gather + SDPA)."""
    global _extend_supported
    if not available():
        return False
    if _extend_supported is None:
        _extend_supported = bool(torch.ops.sgrt_layer.extend_attention_supported())
    return _extend_supported


_callables: dict[str, Callable] = {}


def op(name: str) -> Callable:
    """``torch.ops.sgrt_layer.<name>``'s C++ entry (:func:`sgrt.kernels.build.operator_entry`),
    for the per-layer calls of a decode step. Call after :func:`available` returned True."""
    fn = _callables.get(name)
    if fn is None:
        fn = _callables[name] = operator_entry(getattr(torch.ops.sgrt_layer, name).default)
    return fn


def _register_fakes() -> None:
    lib = "sgrt_layer::"
    torch.library.register_fake(lib + "rms_norm")(lambda x, weight, eps: torch.empty_like(x))
    torch.library.register_fake(lib + "add_rms_norm_")(lambda x, delta, weight, eps: torch.empty_like(x))
    torch.library.register_fake(lib + "rotary_")(lambda qk, cos, sin: qk)
    torch.library.register_fake(lib + "rotary_heads_")(lambda qkv, cos, sin, heads: qkv)
    torch.library.register_fake(lib + "qk_norm_")(lambda qkv, q_weight, k_weight, n_heads, eps: qkv)
    torch.library.register_fake(lib + "silu_mul")(
        lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))
    torch.library.register_fake(lib + "gelu_tanh_mul")(
        lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))
    torch.library.register_fake(lib + "store_kv_")(
        lambda k_cache, v_cache, slots, k, v, k_scale=None, v_scale=None: None)
    torch.library.register_fake(lib + "decode_attention")(
        lambda q, k_cache, v_cache, slots, kv_lens, k_scale=None, v_scale=None:
        q.new_empty(q.shape[0], q.shape[1] * q.shape[2]))
    torch.library.register_fake(lib + "extend_attention")(
        lambda q, k_cache, v_cache, slots, kv_lens, q_lens: q.new_empty(q.shape[0], q.shape[1] * q.shape[2]))
    torch.library.register_fake(lib + "decode_attention_qkv_")(
        lambda qkv, cos, sin, n_heads, q_scale, k_cache, v_cache, new_slots, slots, kv_lens, k_scale=None,
        v_scale=None: qkv.new_empty(qkv.shape[0], n_heads * k_cache.shape[2]))
