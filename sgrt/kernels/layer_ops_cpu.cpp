// Fused CPU operators for the decoder layer's elementwise work and for decode attention.
//
// Each replaces a chain of 4-8 eager PyTorch ops (RMSNorm, rotary embedding, SiLU gating,
// residual add, gather + SDPA for one-query rows) whose per-op dispatch cost dominates the
// non-matmul time of a decode step on a CPU. Every op reproduces the rounding points of the
// eager code it replaces (sgrt/models/llama.py): values are computed in float32 and rounded to
// the tensor dtype (bfloat16, round-to-nearest-even) exactly where the eager ops round, so
// results match eager up to the reduction order of sums (a few float32 ulps before rounding).
// Build flags include -ffp-contract=off so that the compiler does not fuse a*b+c into one FMA
// where the eager code rounds in between.
//
// Registered as torch.ops.sgrt_layer.*; loaded by sgrt/kernels/native.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "sgrt/bf16.h"
#include "sgrt/raw_calls.h"

using at::Tensor;

namespace {

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

inline float to_f(float v) { return v; }
inline float to_f(uint16_t v) { return sgrt::bf16::to_float(v); }

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

void check_cpu_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
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

// x += delta (each sum rounded to T, as the eager residual add), then out = rms_norm_row(x).
template <typename T>
void add_rms_norm_row(T* x, const T* delta, const T* w, T* out, int64_t h, float eps) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) x[i] = from_f<T>(to_f(x[i]) + to_f(delta[i]));
  rms_norm_row(x, w, out, h, eps);
}

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

// ---- rotary embedding (Su et al., arXiv:2104.09864), HF "rotate half" -----------------------
// In place on qk [T, heads, D] (any strides with a contiguous last dim); cos / sin [T, D] in
// qk's dtype: x' = x * cos + rotate_half(x) * sin, each product rounded, then the sum.

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

// ---- Gated activations: SwiGLU (SiLU) and Gemma's GELU-tanh --------------------------------------
// gate_up [T, 2I] -> act(gate) * up [T, I], act(gate) rounded to the dtype before the product, as
// the eager ops round.
// - SiLU (Shazeer, arXiv:2002.05202): silu(g) = g / (1 + exp(-g)).
// - GELU-tanh, as F.gelu(gate, approximate="tanh"): 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g +
//   0.044715 g^3), in the eager kernel's order, with tanh(u) = 1 - 2 / (1 + exp(2u)) on fast_exp
//   (so that it reaches -1 / 1 where float32's tanh does: gelu's negative tail is exactly 0, as in
//   torch).

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

Tensor silu_mul_into(const Tensor& gate_up, Tensor out) { return gated_mul_into(gate_up, std::move(out), Silu{}); }
Tensor gelu_tanh_mul_into(const Tensor& gate_up, Tensor out) {
  return gated_mul_into(gate_up, std::move(out), GeluTanh{});
}
Tensor gelu_tanh_mul(const Tensor& gate_up) { return gelu_tanh_mul_into(gate_up, Tensor()); }
Tensor silu_mul(const Tensor& gate_up) { return silu_mul_into(gate_up, Tensor()); }

// ---- decode attention over the KV pool -------------------------------------------------------
// One query per row: q [B, H, D]; k_cache / v_cache [S, Hkv, D] (one layer of the pool);
// slots [B, L] int64 (row b's context is slots[b, :kv_lens[b]]); -> [B, H * D] in q's dtype.
// Softmax attention with scale 1/sqrt(D), scores and sums in float32; the H / Hkv query heads
// of a kv head read its keys once (grouped-query attention, Ainslie et al., arXiv:2305.13245).

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) dst[j] = to_f(src[j]);
}

#if defined(__AVX512F__)
// 16 floats from 16 floats, or from 16 bfloat16 bit patterns (widened exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// scores[i * stride + j] = q_i . k_j for the g query rows qf (g x d floats, already scaled), row i
// against kv head kv_of[i] (non-decreasing: the rows of one kv head next to each other) of the
// keys at slots rs[0..len) (key j's head h at kbase + rs[j] * row + h * d). Key-outer: each key's
// row is read once for all g query rows, its kv heads in order, so one item that spans kv heads
// reads whole rows in slot order (what the hardware prefetcher follows); a query row's
// instructions are the same whichever rows share the call, so its bits do not depend on that.
template <typename R, int DC>
void score_keys(const float* qf, int64_t g, int64_t d_, const R* kbase, const int64_t* kv_of, const int64_t* rs,
                int64_t len, int64_t row, float* scores, int64_t stride) {
  const int64_t d = DC > 0 ? DC : d_;
#if defined(__AVX512F__)
  if constexpr (DC > 0 && DC % 16 == 0) {
    constexpr int NV = DC / 16;
    for (int64_t j = 0; j < len; ++j) {
      const R* kr = kbase + rs[j] * row;
      __m512 kv[NV];
      for (int64_t i = 0; i < g; ++i) {
        if (i == 0 || kv_of[i] != kv_of[i - 1])
          for (int v = 0; v < NV; ++v) kv[v] = load16(kr + kv_of[i] * DC + 16 * v);
        const float* qi = qf + i * DC;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qi), kv[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * v), kv[v], a);
        scores[i * stride + j] = _mm512_reduce_add_ps(a);
      }
    }
    return;
  }
#endif
  std::vector<float> kf(d);
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t i = 0; i < g; ++i) {
      if (i == 0 || kv_of[i] != kv_of[i - 1]) load_row(kbase + rs[j] * row + kv_of[i] * d, kf.data(), d);
      const float* qi = qf + i * d;
      const float* kk = kf.data();
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < d; ++c) s += qi[c] * kk[c];
      scores[i * stride + j] = s;
    }
  }
}

// acc[i * d + c] += sum_j p[i * stride + j] * v_j[c], row i against kv head kv_of[i] of the values
// at slots rs[0..len) (as score_keys: key-outer, each value row read once a key).
template <typename R, int DC>
void accumulate_values(const float* p, int64_t g, int64_t d_, const R* vbase, const int64_t* kv_of,
                       const int64_t* rs, int64_t len, int64_t row, int64_t stride, float* acc) {
  const int64_t d = DC > 0 ? DC : d_;
#if defined(__AVX512F__)
  if constexpr (DC > 0 && DC % 16 == 0) {
    constexpr int NV = DC / 16;
    for (int64_t j = 0; j < len; ++j) {
      const R* vr = vbase + rs[j] * row;
      __m512 vv[NV];
      for (int64_t i = 0; i < g; ++i) {
        if (i == 0 || kv_of[i] != kv_of[i - 1])
          for (int v = 0; v < NV; ++v) vv[v] = load16(vr + kv_of[i] * DC + 16 * v);
        __m512 w = _mm512_set1_ps(p[i * stride + j]);
        float* ai = acc + i * DC;
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ai + 16 * v, _mm512_fmadd_ps(w, vv[v], _mm512_loadu_ps(ai + 16 * v)));
      }
    }
    return;
  }
#endif
  std::vector<float> vf(d);
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t i = 0; i < g; ++i) {
      if (i == 0 || kv_of[i] != kv_of[i - 1]) load_row(vbase + rs[j] * row + kv_of[i] * d, vf.data(), d);
      const float* vv = vf.data();
      float w = p[i * stride + j];
      float* ai = acc + i * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) ai[c] += w * vv[c];
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define SGRT_BLOCKED_ATTENTION 1
// The loops of a split context's chunks (head_dim a multiple of 8), for a group of G <= 4 query
// heads of one kv head. Keys and values are widened from bfloat16 in registers (no buffer); each
// key row is loaded once for the G heads; 8 keys' dot products are reduced together (one
// horizontal reduction per 8 scores); the output accumulators stay in registers over a block of
// keys. Rows are addressed through the slot table, so the hardware prefetcher cannot follow them
// when the slots are scattered: the rows kPrefetchAhead keys ahead are prefetched explicitly.
// Sums: a score is each lane's FMA chain over head_dim in order then a fixed tree of the 8 lanes;
// an output value is the FMA chain over the chunk's keys in order (both as the widening kernel of
// before, so split contexts kept their results). One-chunk contexts keep the per-key loops above.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

constexpr int64_t kPrefetchAhead = 16;

// Every cache line of the d values at p, into the cache level `hint` names.
template <int Hint, typename R>
inline void prefetch_row(const R* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < d * static_cast<int64_t>(sizeof(R)); o += 64) _mm_prefetch(c + o, static_cast<_mm_hint>(Hint));
}

// [sum(a[0]), ..., sum(a[7])]: the lane sums of 8 vectors, (l0 + l1) + (l2 + l3) + ((l4 + l5) + (l6 + l7)).
inline __m256 lane_sums8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// The vector width of the grouped loops below: 8 lanes (AVX2), or 16 on AVX-512 CPUs where
// head_dim is a multiple of 16 (half the instructions a value). `keys`: keys a pass over head_dim
// in score_keys_grouped (2 G or 4 G independent FMA chains); `w4`: value vectors a head when 4
// heads share a pass (the accumulators must fit in the 16 / 32 vector registers). `fold` halves
// a 16-lane score partial into 8 lanes (its halves added lane by lane) for lane_sums8's tree.
struct Lanes8 {
  using V = __m256;
  static constexpr int n = 8, keys = 2, w4 = 2;
  static V zero() { return _mm256_setzero_ps(); }
  template <typename R>
  static V load(const R* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256 fold(V a) { return a; }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int n = 16, keys = 4, w4 = 4;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename R>
  static V load(const R* p) { return load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __m256 fold(V a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
};
#endif

// score_keys' contract for G query heads (qf: G rows of d floats), DC: head_dim if known at
// compile time (else 0: d), a multiple of L::n. L::keys keys per pass over head_dim; the last
// block of fewer than 8 keys repeats its last key (its extra scores are not stored). kpf / vpf /
// npf: the rows kPrefetchAhead keys ahead to prefetch (npf values from each), the values into L2
// for accumulate_values_grouped.
template <typename L, typename R, int G, int DC>
void score_keys_grouped(const float* qf, int64_t d_, const R* kbase, const int64_t* rs, int64_t len, int64_t row,
                        float* scores, int64_t stride, const R* kpf, const R* vpf, int64_t npf) {
  using V = typename L::V;
  constexpr int KP = L::keys;
  const int64_t d = DC > 0 ? DC : d_;
  for (int64_t j0 = 0; j0 < len; j0 += 8) {
    const int64_t last = std::min<int64_t>(8, len - j0) - 1;
    __m256 part[G][8];
    for (int64_t k = 0; k < 8; k += KP) {
      const R* kr[KP];
      for (int u = 0; u < KP; ++u) {
        const int64_t j = j0 + std::min<int64_t>(k + u, last);
        kr[u] = kbase + rs[j] * row;
        if (k + u <= last && j + kPrefetchAhead < len) {
          prefetch_row<_MM_HINT_T0>(kpf + rs[j + kPrefetchAhead] * row, npf);
          prefetch_row<_MM_HINT_T1>(vpf + rs[j + kPrefetchAhead] * row, npf);
        }
      }
      V a[G][KP];
      for (int i = 0; i < G; ++i)
        for (int u = 0; u < KP; ++u) a[i][u] = L::zero();
      for (int64_t c = 0; c < d; c += L::n) {
        V x[KP];
        for (int u = 0; u < KP; ++u) x[u] = L::load(kr[u] + c);
        for (int i = 0; i < G; ++i) {
          const V qv = L::load(qf + i * d + c);
          for (int u = 0; u < KP; ++u) a[i][u] = L::fma(qv, x[u], a[i][u]);
        }
      }
      for (int i = 0; i < G; ++i)
        for (int u = 0; u < KP; ++u) part[i][k + u] = L::fold(a[i][u]);
    }
    for (int i = 0; i < G; ++i) {
      const __m256 sums = lane_sums8(part[i]);
      float* si = scores + i * stride + j0;
      if (last == 7) {
        _mm256_storeu_ps(si, sums);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, sums);
        std::copy(tmp, tmp + last + 1, si);
      }
    }
  }
}

// accumulate_values' contract for G query heads (acc: G rows of d floats), W vectors of L::n
// output values per head in registers at a time: blocks of kValueBlock keys (their rows stay in
// L1 between the passes over head_dim), each pass W * L::n values of the G heads over the block's
// keys.
constexpr int64_t kValueBlock = 32;
template <typename L, typename R, int G, int W, int DC>
void accumulate_values_grouped(const float* p, int64_t d_, const R* vbase, const int64_t* rs, int64_t len, int64_t row,
                               int64_t stride, float* acc) {
  using V = typename L::V;
  const int64_t d = DC > 0 ? DC : d_;
  for (int64_t j0 = 0; j0 < len; j0 += kValueBlock) {
    const int64_t j1 = std::min(len, j0 + kValueBlock);
    for (int64_t c0 = 0; c0 < d; c0 += L::n * W) {
      V o[G][W];
      for (int i = 0; i < G; ++i)
        for (int w = 0; w < W; ++w) o[i][w] = L::load(acc + i * d + c0 + L::n * w);
      for (int64_t j = j0; j < j1; ++j) {
        const R* vr = vbase + rs[j] * row + c0;
        V pj[G];
        for (int i = 0; i < G; ++i) pj[i] = L::set1(p[i * stride + j]);
        for (int w = 0; w < W; ++w) {
          const V x = L::load(vr + L::n * w);
          for (int i = 0; i < G; ++i) o[i][w] = L::fma(pj[i], x, o[i][w]);
        }
      }
      for (int i = 0; i < G; ++i)
        for (int w = 0; w < W; ++w) L::store(acc + i * d + c0 + L::n * w, o[i][w]);
    }
  }
}

// The grouped loops over gi query heads (any count; groups of at most 4 heads, each group
// reading the keys and values again, from cache), in L's lanes (d: a multiple of L::n).
template <typename L, typename R, int DC>
void score_keys_in(const float* qf, int64_t gi, int64_t d, const R* kbase, const int64_t* rs, int64_t len, int64_t row,
                   float* scores, int64_t stride, const R* kpf, const R* vpf, int64_t npf) {
  for (int64_t i = 0; i < gi; i += 4) {
    const float* q = qf + i * d;
    float* s = scores + i * stride;
    switch (std::min<int64_t>(4, gi - i)) {
      case 4: score_keys_grouped<L, R, 4, DC>(q, d, kbase, rs, len, row, s, stride, kpf, vpf, npf); break;
      case 3: score_keys_grouped<L, R, 3, DC>(q, d, kbase, rs, len, row, s, stride, kpf, vpf, npf); break;
      case 2: score_keys_grouped<L, R, 2, DC>(q, d, kbase, rs, len, row, s, stride, kpf, vpf, npf); break;
      default: score_keys_grouped<L, R, 1, DC>(q, d, kbase, rs, len, row, s, stride, kpf, vpf, npf); break;
    }
  }
}

template <typename L, typename R, int DC>
void accumulate_values_in(const float* p, int64_t gi, int64_t d, const R* vbase, const int64_t* rs, int64_t len,
                          int64_t row, int64_t stride, float* acc) {
  for (int64_t i = 0; i < gi; i += 4) {
    const float* pi = p + i * stride;
    float* a = acc + i * d;
    const int64_t n = std::min<int64_t>(4, gi - i);
    if (d % (4 * L::n) == 0) {  // 4 vectors a head, L::w4 for 4 heads
      switch (n) {
        case 4: accumulate_values_grouped<L, R, 4, L::w4, DC>(pi, d, vbase, rs, len, row, stride, a); break;
        case 3: accumulate_values_grouped<L, R, 3, 4, DC>(pi, d, vbase, rs, len, row, stride, a); break;
        case 2: accumulate_values_grouped<L, R, 2, 4, DC>(pi, d, vbase, rs, len, row, stride, a); break;
        default: accumulate_values_grouped<L, R, 1, 4, DC>(pi, d, vbase, rs, len, row, stride, a); break;
      }
    } else {
      switch (n) {
        case 4: accumulate_values_grouped<L, R, 4, 1, DC>(pi, d, vbase, rs, len, row, stride, a); break;
        case 3: accumulate_values_grouped<L, R, 3, 1, DC>(pi, d, vbase, rs, len, row, stride, a); break;
        case 2: accumulate_values_grouped<L, R, 2, 1, DC>(pi, d, vbase, rs, len, row, stride, a); break;
        default: accumulate_values_grouped<L, R, 1, 1, DC>(pi, d, vbase, rs, len, row, stride, a); break;
      }
    }
  }
}

// The grouped loops in 16 lanes where the CPU and head_dim allow, else in 8 (d: a multiple of 8).
// The 16-lane sums run in another order than the 8-lane ones (each lane's chain over head_dim
// is half as long, then folded): float32 results an ulp or so apart.
template <typename R, int DC>
void score_keys_blocked(const float* qf, int64_t gi, int64_t d, const R* kbase, const int64_t* rs, int64_t len,
                        int64_t row, float* scores, int64_t stride, const R* kpf, const R* vpf, int64_t npf) {
#if defined(__AVX512F__)
  if (d % 16 == 0) return score_keys_in<Lanes16, R, DC>(qf, gi, d, kbase, rs, len, row, scores, stride, kpf, vpf, npf);
#endif
  score_keys_in<Lanes8, R, DC>(qf, gi, d, kbase, rs, len, row, scores, stride, kpf, vpf, npf);
}

template <typename R, int DC>
void accumulate_values_blocked(const float* p, int64_t gi, int64_t d, const R* vbase, const int64_t* rs, int64_t len,
                               int64_t row, int64_t stride, float* acc) {
#if defined(__AVX512F__)
  if (d % 16 == 0) return accumulate_values_in<Lanes16, R, DC>(p, gi, d, vbase, rs, len, row, stride, acc);
#endif
  accumulate_values_in<Lanes8, R, DC>(p, gi, d, vbase, rs, len, row, stride, acc);
}
#endif

// Flash decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): a context
// longer than kDecodeChunk keys is split into chunks of kDecodeChunk keys; every (row, kv head,
// chunk) is one work item that computes its chunk's max score, sum of exponentials and
// unnormalised output, and the chunks of a (row, kv head) are merged in chunk order by their
// log-sum-exp. The chunk size is fixed (not derived from the thread count), so the result does
// not depend on the thread count; a context of one chunk or less is one item that normalises
// directly, as the kernel did before it split long contexts.
constexpr int64_t kDecodeChunk = 256;

// One work item: keys [c0, c0 + n) of row r's context for its query heads [q0, q1) (each against
// its own kv head q / g; an item may span kv heads). Each query head's scores, softmax and output
// are computed on their own (the same instructions whichever heads share an item), so how the
// heads are grouped into items changes which thread computes a head, not its bits.
struct AttendItem {
  int64_t r, c0, n;
  int64_t part0;  // the partial of this chunk's kv head 0 (head q's: part0 + q / g); -1: the row's
                  // only chunk, written to out directly
  int64_t q0, q1;
};

// The work of one decode attention call, which depends only on the rows' context lengths, the
// heads and the number of threads (so the decode plan makes it once a step per slot table and
// every layer of that table reuses it): the items, and the (row, kv head, query head) triples of
// split rows whose chunks' partials are merged afterwards.
struct AttendWork {
  int64_t g = 0, hkv = 0, d = 0;
  int64_t span = 0;       // scores buffer stride: the longest item's keys
  int64_t part_size = 0;  // floats a partial: g maxima, g sums, g * d unnormalised outputs
  std::vector<AttendItem> items;
  std::vector<int64_t> merges;      // (r * hkv + kh) * g + i, rows of more than one chunk
  std::vector<int64_t> first_part;  // per row: its chunk 0, kv head 0's partial (-1: one chunk)
  std::vector<float> partials;      // [partials, part_size]
};

// Items ordered row, chunk, query heads; partials of split rows laid out row, chunk, kv head: row
// r's chunk c, kv head kh at first_part[r] + c * hkv + kh. An item is a (row, chunk, kv head) with
// its g query heads; where those items are fewer than 4 a thread and do not divide evenly among
// `threads` (SmolLM2's 3 kv heads on 2 threads: 2 : 1; Gemma 3's one: 1 : 0), a (row, chunk)'s
// query heads are cut into `threads` contiguous ranges instead (9: 5 + 4 heads, 4: 2 + 2), which
// may span kv heads: an item reads the key / value rows of its kv heads key by key, so a thread
// reads the slots' rows in order (the hardware prefetcher follows; per query head, as before,
// each thread re-read a kv head's keys once a head, ~3.5 GB/s from memory at 128 keys).
void plan_attention(AttendWork& w, int64_t b, int64_t h, int64_t hkv, int64_t d, const int64_t* ln, int64_t max_kv,
                    int64_t threads) {
  const int64_t g = h / hkv;
  w.g = g;
  w.hkv = hkv;
  w.d = d;
  w.span = std::min(max_kv, kDecodeChunk);
  w.part_size = g * (d + 2);
  w.items.clear();
  w.merges.clear();
  w.first_part.assign(b, -1);
  int64_t base = 0;
  for (int64_t r = 0; r < b; ++r) base += (ln[r] + kDecodeChunk - 1) / kDecodeChunk * hkv;
  const bool ranges = threads > 1 && base % threads != 0 && base < 4 * threads;
  const int64_t cuts = ranges ? std::min(threads, h) : hkv;  // items a (row, chunk)
  int64_t parts = 0;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t len = ln[r], chunks = (len + kDecodeChunk - 1) / kDecodeChunk;
    if (chunks > 1) w.first_part[r] = parts;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t part0 = chunks > 1 ? parts : -1;
      if (chunks > 1) parts += hkv;
      for (int64_t t = 0; t < cuts; ++t) {
        w.items.push_back({r, c * kDecodeChunk, std::min(kDecodeChunk, len - c * kDecodeChunk), part0, h * t / cuts,
                           h * (t + 1) / cuts});
      }
    }
    if (chunks > 1)
      for (int64_t k = 0; k < hkv * g; ++k) w.merges.push_back(r * hkv * g + k);
  }
  w.partials.resize(parts * w.part_size);
}

// Where an attention call reads and writes: q [B, H, D] (strides qs0, qs1; last dim contiguous),
// the caches [num_slots, hkv, D], the slot tables, out [B, H * D]; all in one dtype.
struct AttendArgs {
  const void* q;
  int64_t qs0, qs1;
  const void* k;
  const void* v;
  int64_t num_slots;
  const int64_t* sl;  // [B, max_kv]
  const int64_t* ln;  // [B]
  int64_t max_kv;
  void* out;
};

// Per-thread scratch of the attention items, grown and never shrunk.
struct AttendScratch {
  std::vector<float> qf, scores, acc, sums, maxes;
  std::vector<int64_t> kv_of;
};

AttendScratch& attend_scratch() {
  thread_local AttendScratch s;
  return s;
}

template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// The largest of x[0..n) (n >= 1), any NaN among them giving NaN or a number (the softmax's
// scores then come out NaN either way). Eight independent lanes: std::max_element's compare and
// branch per element was a tenth of a long context's attention.
inline float max_of(const float* x, int64_t n) {
  float m[8];
  for (int k = 0; k < 8; ++k) m[k] = x[0];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) m[k] = m[k] < x[j + k] ? x[j + k] : m[k];
  for (; j < n; ++j) m[0] = m[0] < x[j] ? x[j] : m[0];
  float r = m[0];
  for (int k = 1; k < 8; ++k) r = r < m[k] ? m[k] : r;
  return r;
}

// Items [begin, end) of w. DC: head_dim known at compile time (64, 128, 256: AVX-512 paths whose loops
// over it unroll), or 0 for any other head_dim (portable loops). Returns false, with *bad_slot set
// to a slot outside [0, num_slots), if it met one (nothing of a bad item is read, and out is left
// partly unwritten).
template <typename T, int DC>
bool attend_items(const AttendArgs& a, AttendWork& w, int64_t begin, int64_t end, int64_t* bad_slot) {
  using R = raw<T>;
  const int64_t d = DC > 0 ? DC : w.d;
  const int64_t g = w.g, hkv = w.hkv, h = g * hkv, span = w.span, row = hkv * d;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const R* qp = static_cast<const R*>(a.q);
  const R* kp = static_cast<const R*>(a.k);
  const R* vp = static_cast<const R*>(a.v);
  R* op = static_cast<R*>(a.out);
  AttendScratch& sc = attend_scratch();
  float* const qf = at_least(sc.qf, h * d);
  float* const scores = at_least(sc.scores, h * span);
  float* const acc = at_least(sc.acc, h * d);
  float* const sums = at_least(sc.sums, h);
  float* const maxes = at_least(sc.maxes, h);
  int64_t* const kv_of = at_least(sc.kv_of, h);
  bool ok = true;
  for (int64_t it = begin; it < end; ++it) {
    const AttendItem& item = w.items[it];
    const int64_t r = item.r, len = item.n, q0 = item.q0, gi = item.q1 - item.q0;
    const int64_t* rs = a.sl + r * a.max_kv + item.c0;
    // The slots are checked here, in parallel, rather than in a serial pass over every slot of
    // every row before the call (that pass grows with the context, once a layer).
    int64_t lo = 0, hi = 0;
    for (int64_t j = 0; j < len; ++j) {
      lo = std::min(lo, rs[j]);
      hi = std::max(hi, rs[j]);
    }
    if (lo < 0 || hi >= a.num_slots) {
      *bad_slot = lo < 0 ? lo : hi;
      ok = false;
      continue;
    }
    for (int64_t i = 0; i < gi; ++i) {
      float* qi = qf + i * d;
      load_row(qp + r * a.qs0 + (q0 + i) * a.qs1, qi, d);
      for (int64_t c = 0; c < d; ++c) qi[c] *= scale;
      kv_of[i] = (q0 + i) / g;
    }
#ifdef SGRT_BLOCKED_ATTENTION
    const bool blocked = item.part0 >= 0 && d % 8 == 0;
    constexpr int BDC = DC <= 128 ? DC : 0;  // (the blocked loops unrolled over 256 values ran 0.88x)
#else
    const bool blocked = false;
#endif
    // the item's query heads as runs of one kv head each: [i, e) against kv head kh
    auto runs = [&](auto&& f) {
      for (int64_t i = 0, e; i < gi; i = e) {
        for (e = i + 1; e < gi && kv_of[e] == kv_of[i];) ++e;
        f(i, e, kv_of[i]);
      }
    };
    if (blocked) {
#ifdef SGRT_BLOCKED_ATTENTION
      runs([&](int64_t i, int64_t e, int64_t kh) {
        // kv head 0's run prefetches the whole rows (its chunk's other kv heads, next in this
        // thread's work, then find theirs in cache)
        const bool whole = kh == 0;
        score_keys_blocked<R, BDC>(qf + i * d, e - i, d, kp + kh * d, rs, len, row, scores + i * span, span,
                                   whole ? kp : kp + kh * d, whole ? vp : vp + kh * d, whole ? row : d);
      });
#endif
    } else {
      score_keys<R, DC>(qf, gi, d, kp, kv_of, rs, len, row, scores, span);
    }
    for (int64_t i = 0; i < gi; ++i) {
      float* si = scores + i * span;
      float m = max_of(si, len);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < len; ++j) {
        si[j] = fast_exp(si[j] - m);
        total += si[j];
      }
      sums[i] = total;
      maxes[i] = m;
    }
    std::fill(acc, acc + gi * d, 0.f);
    if (blocked) {
#ifdef SGRT_BLOCKED_ATTENTION
      runs([&](int64_t i, int64_t e, int64_t kh) {
        accumulate_values_blocked<R, BDC>(scores + i * span, e - i, d, vp + kh * d, rs, len, row, span, acc + i * d);
      });
#endif
    } else {
      accumulate_values<R, DC>(scores, gi, d, vp, kv_of, rs, len, row, span, acc);
    }
    for (int64_t i = 0; i < gi; ++i) {
      const int64_t q = q0 + i;
      if (item.part0 < 0) {
        R* o = op + r * h * d + q * d;
        float inv = 1.f / sums[i];
        for (int64_t c = 0; c < d; ++c) o[c] = from_f<R>(acc[i * d + c] * inv);
      } else {
        float* pp = w.partials.data() + (item.part0 + q / g) * w.part_size;
        const int64_t k = q % g;
        pp[k] = maxes[i];
        pp[g + k] = sums[i];
        std::copy(acc + i * d, acc + (i + 1) * d, pp + 2 * g + k * d);
      }
    }
  }
  return ok;
}

// Merges [begin, end) of w: a split (row, kv head, query head)'s chunks in chunk order, weights
// exp(m_c - max_c m_c).
template <typename T>
void merge_items(const AttendArgs& a, const AttendWork& w, int64_t begin, int64_t end) {
  using R = raw<T>;
  const int64_t g = w.g, hkv = w.hkv, d = w.d, h = g * hkv;
  R* op = static_cast<R*>(a.out);
  float* const acc = at_least(attend_scratch().acc, d);
  for (int64_t mi = begin; mi < end; ++mi) {
    const int64_t rk = w.merges[mi] / g, i = w.merges[mi] % g, r = rk / hkv, kh = rk % hkv;
    const int64_t chunks = (a.ln[r] + kDecodeChunk - 1) / kDecodeChunk;
    const float* p0 = w.partials.data() + (w.first_part[r] + kh) * w.part_size;
    const int64_t step = hkv * w.part_size;  // from one chunk's partial to the next's
    float m = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, p0[c * step + i]);
    float total = 0.f;
    std::fill(acc, acc + d, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* pc = p0 + c * step;
      float wt = std::exp(pc[i] - m);
      total += wt * pc[g + i];
      const float* ac = pc + 2 * g + i * d;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) acc[e] += wt * ac[e];
    }
    R* o = op + r * h * d + (kh * g + i) * d;
    float inv = 1.f / total;
    for (int64_t e = 0; e < d; ++e) o[e] = from_f<R>(acc[e] * inv);
  }
}

// This thread's share, part of parts, of w's items (end == true: of its merges), q's dtype and
// head_dim chosen here. Returns false with *bad_slot set as attend_items does.
bool attend_share(at::ScalarType dtype, const AttendArgs& a, AttendWork& w, bool merges, int64_t part, int64_t parts,
                  int64_t* bad_slot) {
  const int64_t n = static_cast<int64_t>(merges ? w.merges.size() : w.items.size());
  const int64_t begin = n * part / parts, end = n * (part + 1) / parts;
  bool ok = true;
  dispatch_float(dtype, [&]<typename scalar_t>() {
    if (merges) {
      merge_items<scalar_t>(a, w, begin, end);
    } else if (w.d == 64) {
      ok = attend_items<scalar_t, 64>(a, w, begin, end, bad_slot);
    } else if (w.d == 128) {
      ok = attend_items<scalar_t, 128>(a, w, begin, end, bad_slot);
    } else if (w.d == 256) {  // (Gemma 3)
      ok = attend_items<scalar_t, 256>(a, w, begin, end, bad_slot);
    } else {
      ok = attend_items<scalar_t, 0>(a, w, begin, end, bad_slot);
    }
  });
  return ok;
}

// decode_attention's checks on the caches and slot tables, for a q of b rows of h heads of d values
// in `dtype` (the plan runs them once a step, for every layer, before its thread team starts).
void check_cache_and_tables(const Tensor& k_cache, const Tensor& v_cache, at::ScalarType dtype, int64_t b, int64_t h,
                            int64_t d, const Tensor& slots, const Tensor& kv_lens) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "k_cache and v_cache must be contiguous [slots, kv_heads, head_dim] in q's dtype");
  const int64_t hkv = k_cache.size(1);
  TORCH_CHECK(h > 0 && hkv > 0 && d > 0, "heads, kv_heads and head_dim must be positive, got ", h, ", ", hkv, ", ", d);
  TORCH_CHECK(k_cache.size(2) == d && h % hkv == 0, "head_dim must match and heads must be a multiple of kv_heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == b && slots.is_contiguous(),
              "slots must be contiguous int64 [B, max_kv]");
  TORCH_CHECK(kv_lens.scalar_type() == at::kLong && kv_lens.dim() == 1 && kv_lens.size(0) == b &&
                  kv_lens.is_contiguous(),
              "kv_lens must be contiguous int64 [B]");
  const int64_t* ln = kv_lens.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(ln[r] >= 1 && ln[r] <= slots.size(1), "kv_lens[", r, "] = ", ln[r], " outside 1..", slots.size(1));
  }
}

// q: its data and its row / head strides (a [B, H, D] tensor's, or the QKV projection's output
// read in place by the decode plan).
AttendArgs attend_args(const void* q, int64_t qs0, int64_t qs1, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slots, const Tensor& kv_lens, Tensor& out) {
  return {q, qs0, qs1, k_cache.const_data_ptr(), v_cache.const_data_ptr(), k_cache.size(0),
          slots.const_data_ptr<int64_t>(), kv_lens.const_data_ptr<int64_t>(), slots.size(1), out.data_ptr()};
}

// out: a [B, H * D] buffer of q's dtype to write into, or undefined.
Tensor decode_attention_into(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                             const Tensor& kv_lens, Tensor out) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, heads, head_dim] with a contiguous last dim");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  Tensor lens = kv_lens.contiguous();
  check_cache_and_tables(k_cache, v_cache, q.scalar_type(), b, h, d, slots, lens);
  out = out.defined() ? out : at::empty({b, h * d}, q.options());
  const AttendArgs a = attend_args(q.const_data_ptr(), q.stride(0), q.stride(1), k_cache, v_cache, slots, lens, out);
  thread_local AttendWork own;  // (its vectors reused call to call)
  AttendWork& w = own;  // (a lambda naming a thread_local would read the running thread's own one)
  const int64_t threads = at::get_num_threads();
  plan_attention(w, b, h, k_cache.size(1), d, a.ln, a.max_kv, threads);
  std::vector<int64_t> bad(threads, 0);
  std::vector<uint8_t> is_bad(threads, 0);
  const auto dtype = q.scalar_type();
  for (bool merges : {false, true}) {
    const int64_t n = static_cast<int64_t>(merges ? w.merges.size() : w.items.size());
    if (n == 0) continue;
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) is_bad[t] = !attend_share(dtype, a, w, merges, t, threads, &bad[t]);
    });
    for (int64_t t = 0; t < threads; ++t) TORCH_CHECK(!is_bad[t], "slot ", bad[t], " outside the pool's ", a.num_slots, " slots");
  }
  return out;
}

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                        const Tensor& kv_lens) {
  return decode_attention_into(q, k_cache, v_cache, slots, kv_lens, Tensor());
}

// ---- KV pool write -----------------------------------------------------------------------------
// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for every new token t (both caches in place);
// k / v [T, Hkv, D] may be strided views (the QKV projection's output) with a contiguous last dim.

// new_slots: int64 [B], each in [0, num_slots) (where a step's new K / V go).
void check_new_slots(const Tensor& new_slots, int64_t b, int64_t num_slots) {
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.dim() == 1 && new_slots.size(0) == b &&
                  new_slots.is_contiguous(),
              "new_slots must be a contiguous int64 [B], one slot a row");
  const int64_t* sl = new_slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < num_slots, "slot ", sl[i], " outside the pool's ", num_slots, " slots");
  }
}

void store_kv_(Tensor k_cache, Tensor v_cache, const Tensor& slots, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [slots, kv_heads, head_dim] of one dtype");
  int64_t num_slots = k_cache.size(0), hkv = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots must be int64 [T]");
  int64_t t = slots.size(0);
  for (const Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == t && x->size(1) == hkv && x->size(2) == d && x->stride(2) == 1 &&
                    x->scalar_type() == k_cache.scalar_type(),
                "k and v must be [T, kv_heads, head_dim] in the cache's dtype with a contiguous last dim");
  }
  check_new_slots(slots, t, num_slots);
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  size_t bytes = static_cast<size_t>(d) * k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  int64_t es = k_cache.element_size();
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t hd = 0; hd < hkv; ++hd) {
      size_t dst = (static_cast<size_t>(sl[i]) * hkv + hd) * bytes;
      std::memcpy(kc + dst, kp + (i * k.stride(0) + hd * k.stride(1)) * es, bytes);
      std::memcpy(vc + dst, vp + (i * v.stride(0) + hd * v.stride(1)) * es, bytes);
    }
  }
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

// ---- a decode layer's attention block in one call --------------------------------------------
// decode_attention_qkv_: qkv [B, H + 2 Hkv, D] or [B, (H + 2 Hkv) * D] (the QKV projection's output, one
// token per row):
// q and k heads rotated in place as rotary_ does, q multiplied by q_scale in place (rounded to
// the dtype, as the eager `q * q_scale`; skipped when 1), k / v stored at new_slots [B] as
// store_kv_ does, then decode_attention of q over each row's slots. What rotary_heads_, a split,
// store_kv_ and decode_attention do, in one dispatch instead of four.

// The per-head work between a decode layer's QKV projection and its attention, on raw storage:
// for rows [B] of qkv (row r, head hd at qkv + r * st + hd * sh; heads = n_heads q, hkv k, hkv v,
// d values each), in this order: the projection's bias added (each sum rounded, as the eager
// add), q and k heads RMS-normed (qk_norm_: q_norm / k_norm), rotated (rotary_, this row's cos /
// sin [d]), q heads multiplied by q_scale (rounded; skipped when 1), k and v heads copied to the
// caches [num_slots, hkv, d] at slots[r] (store_kv_). Each (row, head) is independent of the
// others, so the decode plan's thread team splits them (prepare_heads' begin / end) and the bits
// do not depend on the split. Slots must have been checked (0 <= slots[r] < num_slots).
template <typename R>
struct HeadPrep {
  R* qkv;
  int64_t st, sh;
  int64_t b, n_heads, hkv, d;
  const R* bias = nullptr;  // [(n_heads + 2 hkv) * d] or null
  const R* q_norm = nullptr;
  const R* k_norm = nullptr;  // [d] each, or null (both or neither)
  float eps = 0.f;
  const R* cos;
  const R* sin;  // [B, d]
  float q_scale = 1.f;
  R* k_cache;
  R* v_cache;
  const int64_t* slots;  // [B]
};

// Items [begin, end) of the prep's B * (n_heads + 2 hkv) (row, head) items, row-major.
template <typename R>
void prepare_heads(const HeadPrep<R>& a, int64_t begin, int64_t end) {
  const int64_t heads = a.n_heads + 2 * a.hkv, d = a.d, rotated = a.n_heads + a.hkv;
  float stack[512];
  std::vector<float> big;
  float* x = d <= 512 ? stack : (big.resize(d), big.data());
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = i / heads, hd = i % heads;
    R* p = a.qkv + r * a.st + hd * a.sh;
    if (a.bias) {
      const R* bp = a.bias + hd * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) p[j] = from_f<R>(to_f(p[j]) + to_f(bp[j]));
    }
    if (hd < rotated) {
      if (a.q_norm) rms_norm_row<R>(p, hd < a.n_heads ? a.q_norm : a.k_norm, p, d, a.eps);  // (in place)
      rotate_head(p, a.cos + r * d, a.sin + r * d, d, x);
    }
    if (hd < a.n_heads) {
      if (a.q_scale != 1.f) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) p[j] = from_f<R>(to_f(p[j]) * a.q_scale);
      }
    } else {
      const bool is_k = hd < rotated;
      const int64_t kh = is_k ? hd - a.n_heads : hd - rotated;
      std::memcpy((is_k ? a.k_cache : a.v_cache) + (a.slots[r] * a.hkv + kh) * d, p, d * sizeof(R));
    }
  }
}

// The first part of decode_attention_qkv_: rotary, q's pre-scale, the K/V store (prepare_heads
// without bias or q / k norm); returns q [B, n_heads, D] (a view of qkv) for the attention.
Tensor prepare_qkv_(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t n_heads, double q_scale,
                    Tensor k_cache, Tensor v_cache, const Tensor& new_slots) {
  check_cpu_float(qkv, "qkv");
  TORCH_CHECK((qkv.dim() == 2 || qkv.dim() == 3) && k_cache.dim() == 3,
              "qkv must be [B, heads * head_dim] or [B, heads, head_dim] and k_cache [slots, kv_heads, head_dim]");
  const int64_t hkv = k_cache.size(1), d = k_cache.size(2);
  if (qkv.dim() == 2) {
    TORCH_CHECK(qkv.stride(1) == 1 && qkv.size(1) % std::max<int64_t>(d, 1) == 0,
                "a 2-D qkv must be [B, heads * head_dim] with a contiguous last dim");
    qkv = qkv.view({qkv.size(0), -1, d});
  }
  TORCH_CHECK(n_heads > 0 && hkv > 0 && qkv.size(1) == n_heads + 2 * hkv, "qkv must have n_heads + 2 * kv_heads = ",
              n_heads + 2 * hkv, " heads, got ", qkv.size(1));
  TORCH_CHECK(qkv.size(2) == d && qkv.stride(2) == 1, "qkv's head_dim must be the cache's ", d,
              ", with a contiguous last dim");
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  const int64_t b = qkv.size(0);
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({b, d}) && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous [B, head_dim] in qkv's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "k_cache and v_cache must be contiguous [slots, kv_heads, head_dim] in qkv's dtype");
  check_new_slots(new_slots, b, k_cache.size(0));
  dispatch_float(qkv.scalar_type(), [&]<typename scalar_t>() {
    using R = raw<scalar_t>;
    HeadPrep<R> a{raw_ptr<scalar_t>(qkv), qkv.stride(0), qkv.stride(1), b, n_heads, hkv, d};
    a.cos = raw_ptr<scalar_t>(cos);
    a.sin = raw_ptr<scalar_t>(sin);
    a.q_scale = static_cast<float>(q_scale);
    a.k_cache = raw_ptr<scalar_t>(k_cache);
    a.v_cache = raw_ptr<scalar_t>(v_cache);
    a.slots = new_slots.const_data_ptr<int64_t>();
    prepare_heads(a, 0, b * (n_heads + 2 * hkv));
  });
  return qkv.narrow(1, 0, n_heads);
}

// out: a [B, n_heads * head_dim] buffer to write the attention into, or undefined.
Tensor decode_attention_qkv_into(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t n_heads, double q_scale,
                                 Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor& slots,
                                 const Tensor& kv_lens, Tensor out) {
  // the attention's checks first (prepare_qkv_ makes its own), so that a call that raises on its
  // tables or caches has written nothing to the caches (its context slots are checked in the items)
  TORCH_CHECK(qkv.dim() >= 1 && k_cache.dim() == 3, "qkv must be [B, ...] and k_cache [slots, kv_heads, head_dim]");
  check_cache_and_tables(k_cache, v_cache, qkv.scalar_type(), qkv.size(0), n_heads, k_cache.size(2), slots,
                         kv_lens.contiguous());
  Tensor q = prepare_qkv_(std::move(qkv), cos, sin, n_heads, q_scale, k_cache, v_cache, new_slots);
  return decode_attention_into(q, k_cache, v_cache, slots, kv_lens, out);
}

Tensor decode_attention_qkv_(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t n_heads, double q_scale,
                             Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor& slots,
                             const Tensor& kv_lens) {
  return decode_attention_qkv_into(qkv, cos, sin, n_heads, q_scale, k_cache, v_cache, new_slots, slots, kv_lens,
                                   Tensor());
}


// ---- the decode step: every decoder layer of the model in one call -------------------------------
// A batch-1 decode step of a small model is bound by per-op overhead, not by its kernels: ~8
// Python -> operator round trips a layer cost more than the layer's norms and attention. DecodePlan
// holds a model's per-layer weights and switches (built once per model by sgrt/models/native_step.py)
// and forward() runs a decode-only forward (every row one new token) through the embedding, every
// layer and the final norm in one call, with per-step buffers reused across layers.
//
// NOTE: it MUST stay in step with DecoderLayer.forward and CausalLM.forward (sgrt/models/layers.py)
// on the native path: the same operators (these ops, the projections' own kernels, and the ATen ops
// that path uses for q/k norm, bias and the embedding), in the same order, so that the hidden
// states and the K/V written are bit-identical; tests/models/test_native_step.py checks every family.

using WoqLinear = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                         int64_t);
using DenseLinear = Tensor(const Tensor&, const Tensor&);

// One fused projection: the weight-only quantized kernel's arguments (bits 4 / 8, as GroupLinear
// passes them), or the dense kernel's (bits 0, as DenseLinear passes them); the kernel's raw calls
// where its library has them (sgrt/raw_calls.h: its computation on raw storage behind the
// registered operator, which the plan calls directly: no dispatcher, no argument checks and no
// output allocation per call), else all null.
struct Projection {
  Tensor weight, scales, offsets;
  int64_t n = 0, k = 0, bits = 0, group = 0;
  sgrt::RawCalls calls;
  // the projection's own operator (int4 projections with int8 activations run linear_q8 beside
  // int8 ones on linear in one model)
  std::optional<c10::TypedOperatorHandle<WoqLinear>> woq_op;

  int64_t out_features() const { return bits > 0 ? n : weight.size(0); }
};

// The per-step buffers of DecodePlan::forward: reused across layers and, while the batch size and
// dtype stay, across steps (a decode step allocates only its embedding and its output then).
struct Workspace {
  Tensor attn, qkv, o, gate_up, down;  // written by the team's threads together
  // per thread of the team (one where there is none): the residual stream, the norm that feeds a
  // projection, a norm of a projection's output (sandwich), the gating's output
  std::vector<Tensor> x, h, normed, act;
  std::vector<Tensor> cos, sin;  // per rotary table: the rows of this step's positions [B, head_dim]
  std::vector<AttendWork> attend;  // per slot table: the attention's work items (thread team)

  // slot as a [rows, cols] tensor with `options`, reusing its storage where it has that shape
  static Tensor& get(Tensor& slot, int64_t rows, int64_t cols, const at::TensorOptions& options) {
    if (!slot.defined() || slot.size(0) != rows || slot.size(1) != cols || slot.dtype() != options.dtype()) {
      slot = at::empty({rows, cols}, options);
    }
    return slot;
  }
};

// Where DecodePlan::run's layer loop runs: on the calling thread alone (team false: every
// operator opens its own parallel region, as outside the plan), or as thread `part` of a team of
// `parts` threads that forward() opened once for the whole step (one OpenMP region a step instead
// of one an operator: ~150 for SmolLM2). In a team, the projections and the attention split their
// work by part, and barrier() separates an operator's writes from the next one's reads; an
// exception on one thread is kept (first one wins) and the other threads skip the rest of the step's
// work but still meet every barrier, so none waits forever.
struct TeamState {
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::exception_ptr error;
  std::atomic<bool> bad{false};  // an attention item met a slot outside the pool
  std::atomic<int64_t> bad_slot{0};
};

struct Team {
  int64_t part = 0, parts = 1;
  bool team = false;
  TeamState* state = nullptr;

  bool lead() const { return part == 0; }
  void barrier() const {
    if (team) {
#pragma omp barrier
    }
  }
  // f() here, unless another thread of the team has failed; its exception kept, not thrown, in a team
  template <typename F>
  void run(F&& f) const {
    if (!team) {
      f();
      return;
    }
    if (state->failed.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(state->mutex);
      if (!state->error) state->error = std::current_exception();
      state->failed.store(true);
    }
  }
};

struct PlanLayer {
  Tensor input_norm, post_attention_norm;
  std::optional<Tensor> pre_feedforward_norm, post_feedforward_norm;  // sandwich norms (Gemma 3)
  std::optional<Tensor> q_norm, k_norm, qkv_bias;
  Projection qkv, o, gate_up, down;
  int64_t rope_id = 0;    // which rotary table (Gemma 3's local one for sliding layers)
  int64_t window_id = 0;  // which slot table of forward()'s (one per distinct sliding window)
  double q_scale = 1.0;
  bool gelu = false;  // GELU-tanh gating instead of SiLU
};

struct DecodePlan : torch::CustomClassHolder {
  Tensor embed;                       // [vocab, hidden]
  std::optional<Tensor> embed_scale;  // 0-dim, in the model's dtype
  Tensor final_norm;
  double eps;
  int64_t n_heads, head_dim;
  std::vector<Tensor> cos, sin;  // float32 rotary tables [positions, head_dim]
  std::vector<PlanLayer> layers;
  std::optional<c10::TypedOperatorHandle<DenseLinear>> dense;  // (a woq projection keeps its own operator)
  // forward()'s buffers; a call that finds them in use by another thread makes its own
  mutable std::mutex workspace_mutex;
  mutable Workspace workspace;
  bool raw_entries = true;  // call the kernels' raw entries where they have them (else the dispatcher)
  bool thread_team = true;  // run a step in one thread team where it applies (team_applies)

  DecodePlan(Tensor embed, std::optional<Tensor> embed_scale, Tensor final_norm, double eps, int64_t n_heads,
             int64_t head_dim, std::vector<Tensor> cos, std::vector<Tensor> sin)
      : embed(std::move(embed)), embed_scale(std::move(embed_scale)), final_norm(std::move(final_norm)), eps(eps),
        n_heads(n_heads), head_dim(head_dim), cos(std::move(cos)), sin(std::move(sin)) {
    TORCH_CHECK(this->cos.size() == this->sin.size(), "one sin table per cos table");
    TORCH_CHECK(n_heads > 0 && head_dim > 0 && head_dim % 2 == 0, "n_heads must be positive and head_dim even and ",
                "positive (rotary rotates halves), got ", n_heads, " and ", head_dim);
    for (size_t i = 0; i < this->cos.size(); ++i) {
      TORCH_CHECK(this->cos[i].dim() == 2 && this->cos[i].scalar_type() == at::kFloat && this->cos[i].is_contiguous() &&
                      this->sin[i].scalar_type() == at::kFloat && this->sin[i].is_contiguous() &&
                      this->sin[i].sizes() == this->cos[i].sizes(),
                  "rotary tables must be contiguous float32 [positions, head_dim]");
    }
  }

  void add_layer(Tensor input_norm, Tensor post_attention_norm, std::optional<Tensor> pre_feedforward_norm,
                 std::optional<Tensor> post_feedforward_norm, std::optional<Tensor> q_norm,
                 std::optional<Tensor> k_norm, std::optional<Tensor> qkv_bias, int64_t rope_id, int64_t window_id,
                 double q_scale, bool gelu) {
    TORCH_CHECK(rope_id >= 0 && rope_id < static_cast<int64_t>(cos.size()), "rope_id ", rope_id, " out of range");
    TORCH_CHECK(pre_feedforward_norm.has_value() == post_feedforward_norm.has_value() && q_norm.has_value() == k_norm.has_value(),
                "sandwich norms and q/k norms come in pairs");
    // (the head prep reads these on raw storage: checked here, once; the bias's size against the
    // qkv projection in set_projection)
    for (const auto* v : {&qkv_bias, &q_norm, &k_norm}) {
      TORCH_CHECK(!*v || ((*v)->scalar_type() == embed.scalar_type() && (*v)->is_contiguous() &&
                          (v == &qkv_bias || (*v)->numel() == head_dim)),
                  "a layer's qkv bias / q / k norm must be contiguous, in the model's dtype, the norms of head_dim values");
    }
    PlanLayer l;
    l.input_norm = std::move(input_norm);
    l.post_attention_norm = std::move(post_attention_norm);
    l.pre_feedforward_norm = std::move(pre_feedforward_norm);
    l.post_feedforward_norm = std::move(post_feedforward_norm);
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
    l.qkv_bias = std::move(qkv_bias);
    l.rope_id = rope_id;
    l.window_id = window_id;
    l.q_scale = q_scale;
    l.gelu = gelu;
    layers.push_back(std::move(l));
  }

  // The last added layer's projection `name` (qkv_proj, o_proj, gate_up_proj, down_proj) runs the
  // operator `op` ("sgrt_woq_avx2::linear" and the like with bits 4 / 8, "sgrt_dense_avx2::linear"
  // with bits 0), looked up once here.
  void set_projection(const std::string& name, const std::string& op, Tensor weight, Tensor scales, Tensor offsets,
                      int64_t n, int64_t k, int64_t bits, int64_t group) {
    TORCH_CHECK(!layers.empty(), "add_layer first");
    PlanLayer& l = layers.back();
    Projection* p = name == "qkv_proj" ? &l.qkv : name == "o_proj" ? &l.o : name == "gate_up_proj" ? &l.gate_up
                  : name == "down_proj" ? &l.down : nullptr;
    TORCH_CHECK(p != nullptr, "unknown projection ", name);
    auto& dispatcher = c10::Dispatcher::singleton();
    auto handle = dispatcher.findSchemaOrThrow(op.c_str(), "");
    Projection proj{std::move(weight), std::move(scales), std::move(offsets), n, k, bits, group};
    if (bits > 0) {
      proj.woq_op = handle.typed<WoqLinear>();
      // the operator's own argument checks, once, on an x of no rows (the raw calls skip them)
      proj.woq_op->call(at::empty({0, k}, at::kBFloat16), proj.weight, proj.scales, proj.offsets, n, k, bits, group);
    } else {
      dense = handle.typed<DenseLinear>();
      TORCH_CHECK(proj.weight.dim() == 2, "a dense projection's weight must be [N, K]");
      dense->call(at::empty({0, proj.weight.size(1)}, proj.weight.options()), proj.weight);
    }
    // The operator's raw calls, if its library has them (`<op>_raw_calls() -> int`: their address),
    // checked here, once: a library built against another sgrt/raw_calls.h is an error now rather
    // than a call through a mismatched signature later. Only this projection's kind is kept.
    if (auto entry = dispatcher.findSchema({op + "_raw_calls", ""})) {
      const auto* calls = reinterpret_cast<const sgrt::RawCalls*>(static_cast<intptr_t>(entry->typed<int64_t()>().call()));
      TORCH_CHECK(calls != nullptr, op, "_raw_calls gave a null address");
      TORCH_CHECK(sgrt::raw_calls_match(*calls), op, "_raw_calls: raw-call ABI version ", calls->version, " (",
                  calls->size, " bytes), but sgrt_layer was built for version ", sgrt::kRawCallsVersion, " (",
                  sizeof(sgrt::RawCalls), " bytes) of sgrt/raw_calls.h: the native libraries loaded in this ",
                  "process were built from different sources");
      if (bits > 0) {
        proj.calls.woq_raw = calls->woq_raw;
        proj.calls.woq_part = calls->woq_part;
      } else {
        proj.calls.dense_raw = calls->dense_raw;
        proj.calls.dense_part = calls->dense_part;
      }
    }
    *p = std::move(proj);
    TORCH_CHECK(p != &l.qkv || !l.qkv_bias || l.qkv_bias->numel() == p->out_features(), "the qkv bias has ",
                l.qkv_bias ? l.qkv_bias->numel() : 0, " values, the qkv projection ", p->out_features(), " features");
  }

  // p's output for x [B, in] (contiguous, the model's dtype): written into `out` (resized to
  // [B, out features]) by the raw entry, else the operator's own new tensor. In a team (t.team),
  // this thread's share of it by the in-team entry into `out`, which forward() sized beforehand.
  Tensor project(const Projection& p, const Tensor& x, Tensor& out, const Team& t) const {
    TORCH_CHECK(p.weight.defined(), "a projection was not set");
    if (p.bits > 0) {
      if (!t.team && (p.calls.woq_raw == nullptr || !raw_entries))
        return p.woq_op->call(x, p.weight, p.scales, p.offsets, p.n, p.k, p.bits, p.group);
      TORCH_CHECK(x.dim() == 2 && x.size(1) == p.k && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
                  "a projection's input must be contiguous bfloat16 [B, ", p.k, "]");
      const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
      const uint8_t* wp = p.weight.const_data_ptr<uint8_t>();
      if (t.team) {
        TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == p.n, "the team's buffers were sized for other layers");
        p.calls.woq_part(xp, x.size(0), wp, p.n, p.k, p.bits, p.group, reinterpret_cast<uint16_t*>(out.data_ptr()), t.part,
                   t.parts);
        return out;
      }
      Workspace::get(out, x.size(0), p.n, x.options());
      p.calls.woq_raw(xp, x.size(0), wp, p.n, p.k, p.bits, p.group, reinterpret_cast<uint16_t*>(out.data_ptr()));
      return out;
    }
    if (!t.team && (p.calls.dense_raw == nullptr || !raw_entries)) return dense->call(x, p.weight);
    const int64_t n = p.weight.size(0), k = p.weight.size(1);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous() && x.scalar_type() == p.weight.scalar_type(),
                "a projection's input must be contiguous [B, ", k, "] in the weight's dtype");
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    if (t.team) {
      TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n, "the team's buffers were sized for other layers");
      p.calls.dense_part(x.const_data_ptr(), x.size(0), p.weight.const_data_ptr(), n, k, bf16, out.data_ptr(), t.part,
                   t.parts);
      return out;
    }
    Workspace::get(out, x.size(0), n, x.options());
    p.calls.dense_raw(x.const_data_ptr(), x.size(0), p.weight.const_data_ptr(), n, k, bf16, out.data_ptr());
    return out;
  }

  // Whether projections call the kernels' raw entries (default) or their operators through the
  // dispatcher (the path of a kernel library without one); the same bits either way (tests).
  // Returns the number of projections that have a raw entry.
  int64_t use_raw_entries(bool enable) {
    raw_entries = enable;
    int64_t n = 0;
    for (const PlanLayer& l : layers)
      for (const Projection* p : {&l.qkv, &l.o, &l.gate_up, &l.down}) n += p->calls.woq_raw || p->calls.dense_raw;
    return n;
  }

  // Whether a step may run in one thread team (default) or every operator opens its own parallel
  // region; the same bits either way (tests). Returns whether a step on this thread would now.
  bool use_thread_team(bool enable) {
    thread_team = enable;
    at::internal::lazy_init_num_threads();
    return team_applies();
  }

  // input_ids, positions [B] int64 (one new token a row); k_layers / v_layers: the KV pool's
  // layers; new_slots [B]: where each row's new K/V go; slots[w] [B, max_kv] / kv_lens[w] [B]:
  // each row's context for the layers of window_id w (PagedAttention.native_decode's tables).
  // -> the final hidden states [B, hidden] in the model's dtype.
  // `embedded`: the rows of input_ids already looked up ([B, hidden], the model's dtype), for a
  // model whose table is quantized (its Python module reads it); otherwise `embed` is the table.
  Tensor forward(const Tensor& input_ids, const Tensor& positions, std::vector<Tensor> k_layers,
                 std::vector<Tensor> v_layers, const Tensor& new_slots, std::vector<Tensor> slots,
                 std::vector<Tensor> kv_lens, std::optional<Tensor> embedded) const {
    std::unique_lock<std::mutex> lock(workspace_mutex, std::try_to_lock);
    Workspace own;  // (only where another thread is in forward() with the plan's workspace)
    return run(lock.owns_lock() ? workspace : own, input_ids, positions, k_layers, v_layers, new_slots, slots,
               kv_lens, embedded);
  }

  // The rows of the rotary tables at `positions` in `dtype` into ws.cos / ws.sin: what
  // cos.index_select(0, positions).to(dtype) gives (round to nearest even for bfloat16).
  void rope_rows(Workspace& ws, const Tensor& positions, at::ScalarType dtype) const {
    TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
                "positions must be a contiguous int64 [B]");
    const int64_t b = positions.size(0);
    const int64_t* pos = positions.const_data_ptr<int64_t>();
    ws.cos.resize(cos.size());
    ws.sin.resize(sin.size());
    for (size_t i = 0; i < cos.size(); ++i) {
      const int64_t rows = cos[i].size(0), d = cos[i].size(1);  // (tables checked at construction)
      for (auto [table, out] : {std::pair{&cos[i], &ws.cos[i]}, std::pair{&sin[i], &ws.sin[i]}}) {
        Workspace::get(*out, b, d, at::TensorOptions().dtype(dtype));
        const float* src = table->const_data_ptr<float>();
        dispatch_float(dtype, [&]<typename scalar_t>() {
          using R = raw<scalar_t>;
          R* dst = raw_ptr<scalar_t>(*out);
          for (int64_t r = 0; r < b; ++r) {
            TORCH_CHECK(pos[r] >= 0 && pos[r] < rows, "position ", pos[r], " out of the rotary table's ", rows);
            for (int64_t j = 0; j < d; ++j) dst[r * d + j] = from_f<R>(src[pos[r] * d + j]);
          }
        });
      }
    }
  }

  // Layer l's prepare_heads on this thread's share of the step's (row, head) items (all of them
  // outside a team). qkv: the QKV projection's output, contiguous [B, (heads + 2 kv heads) *
  // head_dim]; its bias, norms, the rotary rows and the slots were checked by run().
  void prepare_share(const PlanLayer& l, const Tensor& qkv, const Workspace& ws, const Tensor& k_cache,
                     const Tensor& v_cache, const Tensor& new_slots, const Team& t) const {
    TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "a QKV projection's output must be contiguous [B, features]");
    const int64_t b = qkv.size(0), hkv = k_cache.size(1), n = b * (n_heads + 2 * hkv);
    dispatch_float(qkv.scalar_type(), [&]<typename scalar_t>() {
      using R = raw<scalar_t>;
      HeadPrep<R> a{raw_ptr<scalar_t>(qkv), qkv.size(1), head_dim, b, n_heads, hkv, head_dim};
      if (l.qkv_bias) a.bias = raw_ptr<scalar_t>(*l.qkv_bias);
      if (l.q_norm) {
        a.q_norm = raw_ptr<scalar_t>(*l.q_norm);
        a.k_norm = raw_ptr<scalar_t>(*l.k_norm);
        a.eps = static_cast<float>(eps);
      }
      a.cos = raw_ptr<scalar_t>(ws.cos[l.rope_id]);
      a.sin = raw_ptr<scalar_t>(ws.sin[l.rope_id]);
      a.q_scale = static_cast<float>(l.q_scale);
      a.k_cache = raw_ptr<scalar_t>(k_cache);
      a.v_cache = raw_ptr<scalar_t>(v_cache);
      a.slots = new_slots.const_data_ptr<int64_t>();
      prepare_heads(a, n * t.part / t.parts, n * (t.part + 1) / t.parts);
    });
  }

  // Whether this step runs in a thread team (one OpenMP region): more than one thread, not already
  // inside a parallel region, every projection with an in-team entry (and the raw entries on),
  // and every layer's projections of one width (the team's shared buffers are sized once).
  bool team_applies() const {
    if (!thread_team || !raw_entries || layers.empty() || at::get_num_threads() < 2 || omp_in_parallel()) return false;
    const PlanLayer& first = layers.front();
    for (const PlanLayer& l : layers) {
      for (auto [p, q] : {std::pair{&l.qkv, &first.qkv}, std::pair{&l.o, &first.o}, std::pair{&l.gate_up, &first.gate_up},
                          std::pair{&l.down, &first.down}}) {
        if (!p->weight.defined() || (p->bits > 0 ? p->calls.woq_part == nullptr : p->calls.dense_part == nullptr)) return false;
        if (p->out_features() != q->out_features()) return false;
      }
    }
    return true;
  }

  Tensor run(Workspace& ws, const Tensor& input_ids, const Tensor& positions, const std::vector<Tensor>& k_layers,
             const std::vector<Tensor>& v_layers, const Tensor& new_slots, const std::vector<Tensor>& slots,
             const std::vector<Tensor>& kv_lens, const std::optional<Tensor>& embedded) const {
    TORCH_CHECK(k_layers.size() == layers.size() && v_layers.size() == layers.size(), "one KV layer per layer");
    TORCH_CHECK(slots.size() == kv_lens.size(), "one kv_lens per slot table");
    for (const PlanLayer& l : layers) {
      TORCH_CHECK(l.window_id >= 0 && l.window_id < static_cast<int64_t>(slots.size()), "no slot table ", l.window_id);
    }
    TORCH_CHECK(input_ids.dim() == 1 && positions.dim() == 1 && positions.size(0) == input_ids.size(0) &&
                    input_ids.size(0) >= 1,
                "input_ids and positions must be [B] each (B >= 1), one position a row; got ", input_ids.sizes(),
                " and ", positions.sizes());
    // CausalLM.forward: embedding (scaled), the rotary tables' rows for these positions.
    if (embedded) {
      TORCH_CHECK(embedded->dim() == 2 && embedded->size(0) == input_ids.size(0) &&
                      embedded->size(1) == embed.size(1) && embedded->scalar_type() == embed.scalar_type(),
                  "embedded must be [B, hidden] in the model's dtype, one row an id; got ", embedded->sizes());
    } else {
      TORCH_CHECK(embed.size(0) > 0, "this plan's table is quantized: forward() needs the embedded rows");
    }
    Tensor x0 = embedded ? embedded->contiguous() : at::embedding(embed, input_ids);
    if (embed_scale) x0 = at::mul(x0, *embed_scale);
    const auto dtype = x0.scalar_type();
    rope_rows(ws, positions, dtype);
    const int64_t b = x0.size(0), hidden = x0.size(1);
    const auto options = x0.options();
    at::internal::lazy_init_num_threads();  // (this thread's OpenMP thread count, as at::parallel_for sets it)
    const bool in_team = team_applies();
    // Buffers: the attention's output and, in a team, the projections' outputs (shared by the
    // team: each thread writes its share); per thread the residual stream (each thread keeps its
    // own copy and does the small row-wise work itself, which costs less than a barrier), the
    // norm that feeds a projection, a norm of a projection's output (sandwich), the gating.
    const int64_t copies = in_team ? omp_get_max_threads() : 1;
    ws.x.resize(copies);
    ws.h.resize(copies);
    ws.normed.resize(copies);
    ws.act.resize(copies);
    for (int64_t t = 0; t < copies; ++t) {
      Workspace::get(ws.x[t], b, hidden, options).copy_(x0);
      Workspace::get(ws.h[t], b, hidden, options);
      Workspace::get(ws.normed[t], b, hidden, options);
    }
    Workspace::get(ws.attn, b, n_heads * head_dim, options);
    std::vector<Tensor> lens(kv_lens.size());
    // the checks of the attention's and the head prep's inputs (prepare_share's on raw storage),
    // and in a team the attention's work items once per slot table, before any layer runs
    for (size_t w = 0; w < kv_lens.size(); ++w) lens[w] = kv_lens[w].contiguous();
    ws.attend.resize(slots.size());
    std::vector<int64_t> planned(slots.size(), -1);  // kv heads each table's work was made for
    int64_t num_slots = std::numeric_limits<int64_t>::max();  // the smallest layer's pool
    for (size_t i = 0; i < layers.size(); ++i) {
      const PlanLayer& l = layers[i];
      const int64_t w = l.window_id;
      check_cache_and_tables(k_layers[i], v_layers[i], dtype, b, n_heads, head_dim, slots[w], lens[w]);
      const int64_t hkv = k_layers[i].size(1), width = (n_heads + 2 * hkv) * head_dim;
      TORCH_CHECK(l.qkv.out_features() == width, "layer ", i, "'s qkv_proj gives ", l.qkv.out_features(),
                  " features, not (heads + 2 kv heads) * head_dim = ", width);
      TORCH_CHECK(ws.cos[l.rope_id].size(0) == b && ws.cos[l.rope_id].size(1) == head_dim, "rotary table ", l.rope_id,
                  "'s rows must be [B, head_dim]");
      if (in_team && planned[w] < 0) {
        plan_attention(ws.attend[w], b, n_heads, hkv, head_dim, lens[w].const_data_ptr<int64_t>(), slots[w].size(1),
                       copies);
        planned[w] = hkv;
      }
      TORCH_CHECK(!in_team || planned[w] == hkv, "layers of one slot table must have one number of kv heads");
      num_slots = std::min(num_slots, k_layers[i].size(0));
    }
    check_new_slots(new_slots, b, num_slots);
    if (in_team) {
      const PlanLayer& l = layers.front();
      Workspace::get(ws.qkv, b, l.qkv.out_features(), options);
      Workspace::get(ws.o, b, l.o.out_features(), options);
      Workspace::get(ws.gate_up, b, l.gate_up.out_features(), options);
      Workspace::get(ws.down, b, l.down.out_features(), options);
      for (int64_t t = 0; t < copies; ++t) Workspace::get(ws.act[t], b, l.gate_up.out_features() / 2, options);
    }
    TeamState state;
    Tensor out_delta;   // the last layer's output, not yet added to the residual (first thread's)
    auto body = [&](const Team t) {
      Tensor& x = ws.x[t.part];
      Tensor& h = ws.h[t.part];
      Tensor& normed = ws.normed[t.part];
      Tensor delta;  // the previous layer's output, not yet added to x
      for (size_t i = 0; i < layers.size(); ++i) {
        const PlanLayer& l = layers[i];
        // DecoderLayer.forward, step by step.
        t.run([&] {
          if (delta.defined()) {
            add_rms_norm_into(x, delta, l.input_norm, eps, h);
          } else {
            rms_norm_into(x, l.input_norm, eps, h);
          }
        });
        Tensor qkv;
        t.run([&] { qkv = project(l.qkv, h, ws.qkv, t); });
        t.barrier();
        // bias, q / k norm, rotary, q's pre-scale and the K/V store: this thread's share of the heads
        t.run([&] { prepare_share(l, qkv, ws, k_layers[i], v_layers[i], new_slots, t); });
        if (!t.team) {
          t.run([&] {
            decode_attention_into(qkv.view({b, -1, head_dim}).narrow(1, 0, n_heads), k_layers[i], v_layers[i],
                                  slots[l.window_id], kv_lens[l.window_id], ws.attn);
          });
        } else {  // the attention's items, then the merges of split rows' chunks, split by part
          AttendWork& work = ws.attend[l.window_id];
          t.barrier();
          for (bool merges : {false, true}) {
            if (merges && work.merges.empty()) break;
            t.run([&] {
              const AttendArgs a = attend_args(qkv.const_data_ptr(), qkv.size(1), head_dim, k_layers[i], v_layers[i],
                                               slots[l.window_id], lens[l.window_id], ws.attn);
              int64_t bad = 0;
              if (!attend_share(dtype, a, work, merges, t.part, t.parts, &bad)) {
                state.bad_slot.store(bad);
                state.bad.store(true);
              }
            });
            t.barrier();
          }
        }
        Tensor o;
        t.run([&] { o = project(l.o, ws.attn, ws.o, t); });
        t.barrier();
        t.run([&] {
          if (l.pre_feedforward_norm) {
            rms_norm_into(o, l.post_attention_norm, eps, normed);
            add_rms_norm_into(x, normed, *l.pre_feedforward_norm, eps, h);
          } else {
            add_rms_norm_into(x, o, l.post_attention_norm, eps, h);
          }
        });
        Tensor gate_up;
        t.run([&] { gate_up = project(l.gate_up, h, ws.gate_up, t); });
        t.barrier();
        Tensor m;
        t.run([&] {
          Tensor& act = Workspace::get(ws.act[t.part], b, gate_up.size(1) / 2, options);
          m = project(l.down, l.gelu ? gelu_tanh_mul_into(gate_up, act) : silu_mul_into(gate_up, act), ws.down, t);
        });
        t.barrier();
        t.run([&] {
          if (l.post_feedforward_norm) m = rms_norm_into(m, *l.post_feedforward_norm, eps, normed);
          delta = m;
        });
      }
      if (t.lead()) out_delta = delta;
    };
    if (in_team) {
#pragma omp parallel
      {
        const int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
        const Team t{part, parts, true, &state};
        if (parts <= copies) {
          body(t);
        } else if (t.lead()) {  // (cannot happen: a team has at most omp_get_max_threads())
          t.run([&] { TORCH_CHECK(false, "the decode plan's team has ", parts, " threads, buffers for ", copies); });
        }
      }
      if (state.error) std::rethrow_exception(state.error);
      TORCH_CHECK(!state.bad.load(), "slot ", state.bad_slot.load(), " outside the pool's ", k_layers[0].size(0), " slots");
    } else {
      body(Team{});
    }
    Tensor& x = ws.x[0];
    return out_delta.defined() ? add_rms_norm_(x, out_delta, final_norm, eps) : rms_norm(x, final_norm, eps);
  }
};
}  // namespace

TORCH_LIBRARY(sgrt_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def("store_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor kv_lens) -> Tensor");
  m.def("rotary_heads_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> Tensor(a!)");
  m.def("qk_norm_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int n_heads, float eps) -> Tensor(a!)");
  m.def(
      "decode_attention_qkv_(Tensor(a!) qkv, Tensor cos, Tensor sin, int n_heads, float q_scale, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor new_slots, Tensor slots, Tensor kv_lens) -> Tensor");
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<Tensor, std::optional<Tensor>, Tensor, double, int64_t, int64_t, std::vector<Tensor>,
                       std::vector<Tensor>>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("set_projection", &DecodePlan::set_projection)
      .def("use_raw_entries", &DecodePlan::use_raw_entries)
      .def("use_thread_team", &DecodePlan::use_thread_team)
      .def("forward", &DecodePlan::forward);
}

TORCH_LIBRARY_IMPL(sgrt_layer, CPU, m) {
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
}
