// What the files of the layer operators' library (sgrt_layer, sgrt/kernels/layer_ops_cpu/) share:
// the raw storage the kernels work on, the float32 / bfloat16 dispatch, the argument check of
// every operator, and a vectorizable exp (the gated activations', the attention's softmax).
//
// Everything the files share lives in namespace sgrt_layer, declared hidden in every file that
// opens it (a namespace's visibility does not carry over to a reopening without the attribute):
// hidden functions bind within this .so, as the single file's anonymous namespace made them, so
// two builds of the library in one process (bench/native_step.py --base) never call each
// other's code, and GCC may inline them as before. What one file alone uses stays in an
// anonymous namespace there.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "sgrt/bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace [[gnu::visibility("hidden")]] sgrt_layer {

using at::Tensor;

// Scalar types the ops accept: float32 (no rounding) and bfloat16 (rounds to bfloat16, with
// c10::BFloat16's conversion: sgrt::bf16::from_float, branch-free so that loops vectorize).
// The kernels work on raw storage: float, or the uint16_t bits of a bfloat16 (a struct type
// would keep GCC from vectorizing the loops). raw<T> maps a tensor's scalar type to it.
template <typename T>
using raw = std::conditional_t<std::is_same_v<T, c10::BFloat16>, uint16_t, float>;

template <typename T>
inline raw<T>* raw_ptr(const Tensor& t) {
  return reinterpret_cast<raw<T>*>(t.data_ptr<T>());
}

// A per-thread scratch vector grown to at least n elements (never shrunk, not zeroed: callers
// write every element they read): its data.
template <typename T>
inline T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

inline float to_f(float v) { return v; }
inline float to_f(uint16_t v) { return sgrt::bf16::to_float(v); }
inline float to_f(int8_t v) { return static_cast<float>(v); }  // an int8 KV pool's code (times its scale)

template <typename R>
inline R from_f(float v);
template <>
inline float from_f<float>(float v) { return v; }
template <>
inline uint16_t from_f<uint16_t>(float v) { return sgrt::bf16::from_float(v); }

// v rounded to R's precision, kept as float.
template <typename R>
inline float round_as(float v) { return to_f(from_f<R>(v)); }

// Calls f.template operator()<T>() with T = c10::BFloat16 or float (the types check_cpu_float admits).
template <typename F>
void dispatch_float(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16) {
    f.template operator()<c10::BFloat16>();
  } else {
    f.template operator()<float>();
  }
}

inline void check_cpu_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// An int8 KV pool's row (sgrt/engine/kv_pool.py, quantize_int8): the d values of one token's kv head
// at x as symmetric int8 codes q[0..d) and their scale, returned: scale = absmax / 127 (float32),
// q = round-half-even(x / scale) clamped to [-127, 127], all 0 where the row is all zeros. The same
// float32 divisions and rounding as the torch path, so both store the same bits.
template <typename R>
inline float quantize_row_int8(const R* x, int64_t d, int8_t* q) {
  float amax = 0.f;
  for (int64_t j = 0; j < d; ++j) {
    const float a = std::fabs(to_f(x[j]));
    amax = amax < a ? a : amax;
  }
  const float scale = amax / 127.f;
  const float div = scale > 0.f ? scale : 1.f;
  for (int64_t j = 0; j < d; ++j) {
    float c = std::nearbyint(to_f(x[j]) / div);
    c = c < -127.f ? -127.f : (c > 127.f ? 127.f : c);
    q[j] = static_cast<int8_t>(c);
  }
  return scale;
}

// exp(x) for float32, vectorizable (no branches, no calls): Cody-Waite range reduction
// x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for exp(r) (Cephes expf's
// coefficients), and 2^n built in the exponent bits. Within 2 ulp of expf over the range the
// ops use; inputs below -87 give exp(-87) (~1.6e-38, not 0), above 88 saturate; NaN gives NaN.
inline float fast_exp(float x) {
  // NOTE: written so that a NaN stays NaN (std::min / std::max would turn it into a bound).
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  // Round to nearest integer by adding and subtracting 1.5 * 2^23 (exact for |x log2 e| < 2^22).
  float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = static_cast<int32_t>(static_cast<uint32_t>(static_cast<int32_t>(n == n ? n : 0.f) + 127) << 23);
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// exp of 16 floats, fast_exp's steps (clamp to [-87, 88], x = n ln2 + r, Cephes' polynomial,
// times 2^n) with fused multiply-adds and vscalefps for 2^n: within 2 ulp of expf
// as fast_exp; NaN stays NaN (min / max return their second operand where one is NaN).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), _mm512_min_ps(_mm512_set1_ps(88.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace sgrt_layer
