// The decoder layer's elementwise operators (elementwise.cpp), and the row kernels that the
// attention block's head prep (attention_block.h) applies to single heads as well.
#pragma once

#include <cmath>

#include "common.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// ---- RMSNorm (Zhang & Sennrich, arXiv:1910.07467), HF Llama semantics ----------------------
// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32.

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) {
    float v = to_f(x[i]);
    ss += v * v;
  }
  float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    float normed = round_as<T>(to_f(x[i]) * inv);
    out[i] = from_f<T>(to_f(w[i]) * normed);
  }
}

// ---- rotary embedding (Su et al., arXiv:2104.09864), HF "rotate half" -----------------------
// x' = x * cos + rotate_half(x) * sin, each product rounded to the dtype, then the sum.

// One head in place: p [d] (d even), c / s [d] its row's cos / sin; x: d floats of scratch.
// Two loops over the halves (rotate_half's sign differs) so that each vectorizes.
template <typename R>
inline void rotate_head(R* p, const R* c, const R* s, int64_t d, float* x) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) x[j] = to_f(p[j]);
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    float a = round_as<R>(x[j] * to_f(c[j]));
    float bb = round_as<R>(-x[j + half] * to_f(s[j]));
    p[j] = from_f<R>(a + bb);
  }
#pragma omp simd
  for (int64_t j = half; j < d; ++j) {
    float a = round_as<R>(x[j] * to_f(c[j]));
    float bb = round_as<R>(x[j - half] * to_f(s[j]));
    p[j] = from_f<R>(a + bb);
  }
}

// The operators (elementwise.cpp). An `out` argument: a buffer of the result's shape and dtype to
// write into (the decode plan reuses one across layers), or undefined (a new tensor).
Tensor rms_norm_into(const Tensor& x, const Tensor& weight, double eps, Tensor out);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
Tensor add_rms_norm_into(Tensor x, const Tensor& delta, const Tensor& weight, double eps, Tensor out);
Tensor add_rms_norm_(Tensor x, const Tensor& delta, const Tensor& weight, double eps);
Tensor qk_norm_(Tensor qkv, const Tensor& q_weight, const Tensor& k_weight, int64_t n_heads, double eps);
Tensor rotary_(Tensor qk, const Tensor& cos, const Tensor& sin);
Tensor rotary_heads_(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t heads);
Tensor silu_mul_into(const Tensor& gate_up, Tensor out);
Tensor silu_mul(const Tensor& gate_up);
Tensor gelu_tanh_mul_into(const Tensor& gate_up, Tensor out);
Tensor gelu_tanh_mul(const Tensor& gate_up);

}  // namespace sgrt_layer
