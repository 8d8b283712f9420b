// From a decode layer's QKV projection output to its attention (attention_block.cpp): the K/V
// store into the pool and the per-head preparation (bias, q / k norm, rotary, q's pre-scale),
// which the decode plan runs on its thread team's share of the heads.
#pragma once

#include <cstring>
#include <optional>
#include <vector>

#include "elementwise.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// new_slots: int64 [B], each in [0, num_slots) (where a step's new K / V go).
void check_new_slots(const Tensor& new_slots, int64_t b, int64_t num_slots);

// The per-head work between a decode layer's QKV projection and its attention, on raw storage:
// for rows [B] of qkv (row r, head hd at qkv + r * st + hd * sh; heads = n_heads q, hkv k, hkv v,
// d values each), in this order: the projection's bias added (each sum rounded, as the eager
// add), q and k heads RMS-normed (qk_norm_: q_norm / k_norm), rotated (rotary_, this row's cos /
// sin [d]), q heads multiplied by q_scale (rounded; skipped when 1), k and v heads copied to the
// caches [num_slots, hkv, d] at slots[r] (store_kv_), or with k_scale / v_scale set (an int8 pool)
// stored as int8 codes in k_codes / v_codes and their scales [num_slots, hkv] (quantize_row_int8). Each (row, head) is independent of the
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
  R* k_cache = nullptr;
  R* v_cache = nullptr;
  const int64_t* slots;  // [B]
  int8_t* k_codes = nullptr;  // an int8 pool's caches and scales instead of k_cache / v_cache
  int8_t* v_codes = nullptr;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
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
      const int64_t kh = is_k ? hd - a.n_heads : hd - rotated, at = a.slots[r] * a.hkv + kh;
      if (a.k_scale) {
        (is_k ? a.k_scale : a.v_scale)[at] = quantize_row_int8(p, d, (is_k ? a.k_codes : a.v_codes) + at * d);
      } else {
        std::memcpy((is_k ? a.k_cache : a.v_cache) + at * d, p, d * sizeof(R));
      }
    }
  }
}

// The operators (attention_block.cpp).
// k_scale / v_scale: an int8 pool's scales [num_slots, kv heads] (its caches int8), else none.
void store_kv_(Tensor k_cache, Tensor v_cache, const Tensor& slots, const Tensor& k, const Tensor& v,
               const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale);
Tensor decode_attention_qkv_(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t n_heads, double q_scale,
                             Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor& slots,
                             const Tensor& kv_lens, const std::optional<Tensor>& k_scale,
                             const std::optional<Tensor>& v_scale);

}  // namespace sgrt_layer
