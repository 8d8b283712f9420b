// Library sgrt_layer: fused CPU operators for a decoder layer's non-matmul work and for decode
// attention, and the decode plan that runs a whole decode step in one call. Loaded by
// sgrt/kernels/layer_ops.py (which lists these files; sgrt/kernels/build.py compiles them).
//
// Each operator replaces a chain of 4-8 eager PyTorch ops (RMSNorm, rotary embedding, SiLU
// gating, residual add, gather + SDPA for one-query rows) whose per-op dispatch cost dominates the
// non-matmul time of a decode step on a CPU. Every op but extend_attention (gather + SDPA for
// bfloat16 prefill rows, with the rounding points of torch's CPU flash attention and its own
// order of sums: extend_attention.cpp) reproduces the rounding points of the eager code it
// replaces (sgrt/models/layers.py): values are computed in float32 and rounded to the tensor
// dtype (bfloat16, round-to-nearest-even) exactly where the eager ops round, so results match
// eager up to the reduction order of sums (a few float32 ulps before rounding). Build flags
// include -ffp-contract=off so that the compiler does not fuse a*b+c into one FMA where the eager
// code rounds in between.
//
// Files, by concern:
//   common.h            raw storage (float / bfloat16 bits), dtype dispatch, checks, fast_exp
//   elementwise.{h,cpp} RMSNorm, q / k norm, rotary embedding, gated activations
//   attention.{h,cpp}   decode attention over the KV pool (flash decoding, work items)
//   extend_attention.{h,cpp}  extend (prefill) attention over the KV pool, bfloat16 (AVX-512 BF16)
//   attention_block.{h,cpp}  the K/V store and the per-head prep from the QKV output; the fused
//                       decode_attention_qkv_
//   decode_plan.{h,cpp} DecodePlan: every layer of a decode step in one call
//   register.cpp        this file: the library's operator schemas and kernels

#include <torch/library.h>

#include "attention.h"
#include "attention_block.h"
#include "decode_plan.h"
#include "elementwise.h"
#include "extend_attention.h"

TORCH_LIBRARY(sgrt_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def(
      "store_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v, Tensor(c!)? k_scale=None, "
      "Tensor(d!)? v_scale=None) -> ()");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor kv_lens, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> Tensor");
  m.def("rotary_heads_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> Tensor(a!)");
  m.def("qk_norm_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int n_heads, float eps) -> Tensor(a!)");
  m.def(
      "decode_attention_qkv_(Tensor(a!) qkv, Tensor cos, Tensor sin, int n_heads, float q_scale, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor new_slots, Tensor slots, Tensor kv_lens, Tensor(d!)? k_scale=None, "
      "Tensor(e!)? v_scale=None) -> Tensor");
  m.def(
      "extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor kv_lens, Tensor q_lens) -> "
      "Tensor");
  // (no tensor argument: one kernel for every dispatch key)
  m.def("extend_attention_supported() -> bool", &sgrt_layer::extend_attention_supported);
  sgrt_layer::register_decode_plan(m);
}

TORCH_LIBRARY_IMPL(sgrt_layer, CPU, m) {
  using namespace sgrt_layer;
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm_", add_rms_norm_);
  m.impl("rotary_", rotary_);
  m.impl("silu_mul", silu_mul);
  m.impl("gelu_tanh_mul", gelu_tanh_mul);
  m.impl("store_kv_", store_kv_);
  m.impl("decode_attention", decode_attention);
  m.impl("rotary_heads_", rotary_heads_);
  m.impl("qk_norm_", qk_norm_);
  m.impl("decode_attention_qkv_", decode_attention_qkv_);
  m.impl("extend_attention", extend_attention);
}
