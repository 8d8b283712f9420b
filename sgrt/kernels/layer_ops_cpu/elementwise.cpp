// The decoder layer's elementwise operators (torch.ops.sgrt_layer.*, registered in register.cpp):
// RMSNorm (alone, after a residual add, per head of q and k), the rotary embedding (on q and k, or
// on the q and k heads of the QKV projection's output), and the gated activations (SwiGLU, Gemma's
// GELU-tanh). Each reproduces the eager ops' rounding points (sgrt/models/layers.py), see
// register.cpp.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <vector>

#include "elementwise.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// ---- RMSNorm: the operators over rows (rms_norm_row, elementwise.h) ----------------------------

namespace {

// x += delta (each sum rounded to T, as the eager residual add), then out = rms_norm_row(x).
template <typename T>
void add_rms_norm_row(T* x, const T* delta, const T* w, T* out, int64_t h, float eps) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) x[i] = from_f<T>(to_f(x[i]) + to_f(delta[i]));
  rms_norm_row(x, w, out, h, eps);
}

}  // namespace

// out: a [T, hidden] buffer of x's dtype to write into (the decode step reuses one), or undefined.
Tensor rms_norm_into(const Tensor& x, const Tensor& weight, double eps, Tensor out) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "weight must be contiguous [hidden] in x's dtype");
  out = out.defined() ? out : at::empty_like(x);
  int64_t t = x.size(0), h = x.size(1);
  dispatch_float(x.scalar_type(), [&]<typename scalar_t>() {
    using R = raw<scalar_t>;
    const R* xp = raw_ptr<scalar_t>(x);
    const R* wp = raw_ptr<scalar_t>(weight);
    R* op = raw_ptr<scalar_t>(out);
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * h, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) { return rms_norm_into(x, weight, eps, Tensor()); }

// x += delta (rounded to x's dtype, as the eager residual add), then RMSNorm of the new x (into
// out where given, as rms_norm_into).
Tensor add_rms_norm_into(Tensor x, const Tensor& delta, const Tensor& weight, double eps, Tensor out) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  delta.scalar_type() == x.scalar_type(),
              "x and delta must be contiguous [T, hidden] tensors of one dtype");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "weight must be contiguous [hidden] in x's dtype");
  out = out.defined() ? out : at::empty_like(x);
  int64_t t = x.size(0), h = x.size(1);
  dispatch_float(x.scalar_type(), [&]<typename scalar_t>() {
    using R = raw<scalar_t>;
    R* xp = raw_ptr<scalar_t>(x);
    const R* dp = raw_ptr<scalar_t>(delta);
    const R* wp = raw_ptr<scalar_t>(weight);
    R* op = raw_ptr<scalar_t>(out);
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) add_rms_norm_row(xp + r * h, dp + r * h, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

Tensor add_rms_norm_(Tensor x, const Tensor& delta, const Tensor& weight, double eps) {
  return add_rms_norm_into(x, delta, weight, eps, Tensor());
}

// qk_norm_: the per-head RMSNorm of q and k (Qwen3, Gemma 3) in place on the QKV projection's output
// viewed as [T, q + k + v heads, head_dim] (or [T, heads * head_dim]): the first n_heads heads
// with q_weight, the next (heads - n_heads) / 2 with k_weight, each head as rms_norm does a row;
// v untouched. One call instead of RMSNorm.forward's eager ops twice and a cat (~20 a layer).
Tensor qk_norm_(Tensor qkv, const Tensor& q_weight, const Tensor& k_weight, int64_t n_heads, double eps) {
  check_cpu_float(qkv, "qkv");
  const int64_t d = q_weight.dim() == 1 ? q_weight.size(0) : -1;
  TORCH_CHECK(d > 0 && k_weight.dim() == 1 && k_weight.size(0) == d && q_weight.is_contiguous() &&
                  k_weight.is_contiguous() && q_weight.scalar_type() == qkv.scalar_type() &&
                  k_weight.scalar_type() == qkv.scalar_type(),
              "q_weight and k_weight must be contiguous [head_dim] in qkv's dtype");
  if (qkv.dim() == 2) {
    TORCH_CHECK(qkv.stride(1) == 1 && qkv.size(1) % d == 0, "a 2-D qkv must be [T, heads * head_dim=", d,
                "] with a contiguous last dim");
    qkv = qkv.view({qkv.size(0), -1, d});
  }
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) == d && qkv.stride(2) == 1,
              "qkv must be [T, heads, head_dim=", d, "] with a contiguous last dim");
  const int64_t heads = qkv.size(1), n_kv = (heads - n_heads) / 2;
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads + 2 * n_kv == heads, "qkv's ", heads,
              " heads must be n_heads=", n_heads, " plus twice the kv heads");
  const int64_t t = qkv.size(0), st = qkv.stride(0), sh = qkv.stride(1), normed = n_heads + n_kv;
  Tensor out = qkv;
  dispatch_float(qkv.scalar_type(), [&]<typename scalar_t>() {
    using R = raw<scalar_t>;
    R* base = raw_ptr<scalar_t>(qkv);
    const R* wq = raw_ptr<scalar_t>(q_weight);
    const R* wk = raw_ptr<scalar_t>(k_weight);
    // (a decode step's few heads run inline on the calling thread: below the grain)
    at::parallel_for(0, t * normed, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t r = i / normed, hd = i % normed;
        R* p = base + r * st + hd * sh;
        rms_norm_row<R>(p, hd < n_heads ? wq : wk, p, d, static_cast<float>(eps));  // (in place: reads first)
      }
    });
  });
  return out;
}

// ---- rotary embedding: the operator over heads (rotate_head, elementwise.h) ---------------------
// In place on qk [T, heads, D] (any strides with a contiguous last dim); cos / sin [T, D] in
// qk's dtype.

Tensor rotary_(Tensor qk, const Tensor& cos, const Tensor& sin) {
  check_cpu_float(qk, "qk");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [T, heads, head_dim] with a contiguous last dim");
  int64_t t = qk.size(0), heads = qk.size(1), d = qk.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({t, d}) && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == qk.scalar_type() &&
                  sin.scalar_type() == qk.scalar_type(),
              "cos and sin must be contiguous [T, head_dim] in qk's dtype");
  dispatch_float(qk.scalar_type(), [&]<typename scalar_t>() {
    using R = raw<scalar_t>;
    R* base = raw_ptr<scalar_t>(qk);
    const R* cp = raw_ptr<scalar_t>(cos);
    const R* sp = raw_ptr<scalar_t>(sin);
    int64_t st = qk.stride(0), sh = qk.stride(1);
    at::parallel_for(0, t * heads, 64, [&](int64_t b, int64_t e) {
      std::vector<float> x(d);
      for (int64_t i = b; i < e; ++i) {
        int64_t r = i / heads, hd = i % heads;
        rotate_head(base + r * st + hd * sh, cp + r * d, sp + r * d, d, x.data());
      }
    });
  });
  return qk;
}

// ---- decode-step helpers (fewer dispatches a layer) ----------------------------------------------
// rotary_heads_: in place on the QKV projection's output viewed as [T, q + k + v heads, D]: the
// first `heads` heads (q then k) rotated exactly as rotary_ does, the rest (v) left as they are.
// One call instead of slicing q and k out first.

Tensor rotary_heads_(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3, "qkv must be [T, heads, head_dim], got ", qkv.dim(), " dims");
  TORCH_CHECK(heads >= 0 && heads <= qkv.size(1), "heads must be in 0..", qkv.size(1), ", got ", heads);
  rotary_(qkv.narrow(1, 0, heads), cos, sin);
  return qkv;
}

// ---- Gated activations: SwiGLU (SiLU) and Gemma's GELU-tanh --------------------------------------
// gate_up [T, 2I] -> act(gate) * up [T, I], act(gate) rounded to the dtype before the product, as
// the eager ops round.
// - SiLU (Shazeer, arXiv:2002.05202): silu(g) = g / (1 + exp(-g)).
// - GELU-tanh, as F.gelu(gate, approximate="tanh"): 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g +
//   0.044715 g^3), in the eager kernel's order, with tanh(u) = 1 - 2 / (1 + exp(2u)) on fast_exp
//   (so that it reaches -1 / 1 where float32's tanh does: gelu's negative tail is exactly 0, as in
//   torch).

namespace {

struct Silu {
  float operator()(float g) const { return g / (1.f + fast_exp(-g)); }
};

struct GeluTanh {
  float operator()(float g) const {
    float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2/pi) (g + 0.044715 g^3)
    float th = 1.f - 2.f / (1.f + fast_exp(2.f * u));  // tanh(u): exactly -1 / 1 where float32's saturates
    return 0.5f * g * (1.f + th);
  }
};

template <typename T, typename Act>
void gated_rows(const T* in, T* out, int64_t rows, int64_t n, Act act) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = in + r * 2 * n;
    const T* up = gate + n;
    T* o = out + r * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      float s = round_as<T>(act(to_f(gate[j])));
      o[j] = from_f<T>(s * to_f(up[j]));
    }
  }
}

// out: a [T, intermediate] buffer to write into, or undefined.
template <typename Act>
Tensor gated_mul_into(const Tensor& gate_up, Tensor out, Act act) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [T, 2 * intermediate]");
  int64_t t = gate_up.size(0), n = gate_up.size(1) / 2;
  out = out.defined() ? out : at::empty({t, n}, gate_up.options());
  dispatch_float(gate_up.scalar_type(), [&]<typename scalar_t>() {
    using R = raw<scalar_t>;
    const R* in = raw_ptr<scalar_t>(gate_up);
    R* op = raw_ptr<scalar_t>(out);
    at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) { gated_rows(in + b * 2 * n, op + b * n, e - b, n, act); });
  });
  return out;
}

}  // namespace

Tensor silu_mul_into(const Tensor& gate_up, Tensor out) { return gated_mul_into(gate_up, std::move(out), Silu{}); }
Tensor gelu_tanh_mul_into(const Tensor& gate_up, Tensor out) {
  return gated_mul_into(gate_up, std::move(out), GeluTanh{});
}
Tensor gelu_tanh_mul(const Tensor& gate_up) { return gelu_tanh_mul_into(gate_up, Tensor()); }
Tensor silu_mul(const Tensor& gate_up) { return silu_mul_into(gate_up, Tensor()); }

}  // namespace sgrt_layer
