// Decode attention over the KV pool (torch.ops.sgrt_layer.decode_attention, and the decode
// plan's attention): one query per row, straight from the pool's slots (no gathered copy), the
// query heads of a kv head reading its keys once; long contexts split into chunks of
// kDecodeChunk keys merged by their log-sum-exp (flash decoding, attention.h). The work items
// (plan_attention) are made once a call, or once a step by the plan's thread team
// (decode_plan.cpp), and run by attend_share on each thread.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// ---- decode attention over the KV pool -------------------------------------------------------
// One query per row: q [B, H, D]; k_cache / v_cache [S, Hkv, D] (one layer of the pool; in q's
// dtype, or int8 codes with k_scale / v_scale float32 [S, Hkv]); slots [B, L] int64 (row b's context is slots[b, :kv_lens[b]]); -> [B, H * D] in q's dtype.
// Softmax attention with scale 1/sqrt(D), scores and sums in float32; the H / Hkv query heads
// of a kv head read its keys once (grouped-query attention, Ainslie et al., arXiv:2305.13245).

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) dst[j] = to_f(src[j]);
}

// f(i, e, kh) for each run [i, e) of an item's gi query heads that share kv head kh (kv_of[0..gi):
// each head's kv head, ascending).
template <typename F>
inline void for_each_kv_run(const int64_t* kv_of, int64_t gi, F&& f) {
  for (int64_t i = 0, e; i < gi; i = e) {
    for (e = i + 1; e < gi && kv_of[e] == kv_of[i];) ++e;
    f(i, e, kv_of[i]);
  }
}

#if defined(__AVX512F__)
// 16 floats from 16 floats, or from 16 bfloat16 bit patterns (widened exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 16 int8 codes of an int8 KV pool, widened exactly (their scale is applied to the score / weight).
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
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
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
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

// The largest of x[0..n) (n >= 1), any NaN among them giving NaN or a number (the softmax's
// scores then come out NaN either way). Eight independent lanes: std::max_element's compare and
// branch per element was a tenth of a long context's attention.
inline float max_of(const float* x, int64_t n) {
  int64_t j = 0;
  float r = x[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(x);
    for (j = 16; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + j));
    r = _mm512_reduce_max_ps(m);
  }
#endif
  float m[8];
  for (int k = 0; k < 8; ++k) m[k] = r;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) m[k] = m[k] < x[j + k] ? x[j + k] : m[k];
  for (; j < n; ++j) m[0] = m[0] < x[j] ? x[j] : m[0];
  for (int k = 1; k < 8; ++k) r = r < m[k] ? m[k] : r;
  return r < m[0] ? m[0] : r;
}

#if defined(__AVX512F__)
// The lanes of ScaleRows: u * hkv + kh for u < 16.
inline __m512i scale_lanes(int64_t hkv, int64_t kh) {
  return _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int32_t>(hkv))),
                          _mm512_set1_epi32(static_cast<int32_t>(kh)));
}

// The scales of kv head kh of 16 consecutive slots, whose rows of hkv floats start at `rows`:
// rows[kh], rows[hkv + kh], ..., rows[15 * hkv + kh]. Up to 4 kv heads the 16 rows are hkv whole
// vectors, picked from by two permutes (a permute reads an index's low 5 bits: lanes 0..31 from
// the first two vectors, 32..63 from the last two); more kv heads: a gather (microcoded on AMD,
// and in the score loops' critical path).
struct ScaleRows {
  __m512i lanes;
  __mmask16 high;  // lanes >= 32
  int64_t hkv;
  ScaleRows(int64_t hkv_, int64_t kh)
      : lanes(scale_lanes(hkv_, kh)), high(_mm512_cmpge_epi32_mask(lanes, _mm512_set1_epi32(32))), hkv(hkv_) {}
  __m512 load(const float* rows) const {
    if (hkv == 1) return _mm512_loadu_ps(rows);
    if (hkv > 4) return _mm512_i32gather_ps(lanes, rows, 4);
    const __m512 v0 = _mm512_loadu_ps(rows), v1 = _mm512_loadu_ps(rows + 16);
    if (hkv == 2) return _mm512_permutex2var_ps(v0, lanes, v1);
    const __m512 v2 = _mm512_loadu_ps(rows + 32), v3 = hkv == 4 ? _mm512_loadu_ps(rows + 48) : v2;
    return _mm512_mask_blend_ps(high, _mm512_permutex2var_ps(v0, lanes, v1), _mm512_permutex2var_ps(v2, lanes, v3));
  }
};

// The scales of 16 consecutive slots of one kv head: base[0], base[hkv], ..., base[15 * hkv].
inline __m512 gather16(const float* base, int64_t hkv) { return _mm512_i32gather_ps(scale_lanes(hkv, 0), base, 4); }

// Whether s[0..16) are s[0], s[0] + 1, ..., s[0] + 15.
inline bool consecutive16(const int64_t* s) {
  const __m512i base = _mm512_set1_epi64(s[0]);
  const __m512i lo = _mm512_add_epi64(base, _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
  const __m512i hi = _mm512_add_epi64(base, _mm512_setr_epi64(8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s), lo) == 0xFF &&
         _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s + 8), hi) == 0xFF;
}
#endif

// out[j] = scales[rs[j] * hkv] for j < len (an int8 pool's scales of one kv head, through the
// slot table); consecutive slots, the usual case, by one strided gather a 16 keys.
inline void gather_scales(const float* scales, int64_t hkv, const int64_t* rs, int64_t len, float* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= len; j += 16) {
    if (consecutive16(rs + j)) {
      _mm512_storeu_ps(out + j, gather16(scales + rs[j] * hkv, hkv));
    } else {
      for (int64_t u = j; u < j + 16; ++u) out[u] = scales[rs[u] * hkv];
    }
  }
#endif
  for (; j < len; ++j) out[j] = scales[rs[j] * hkv];
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SGRT_INT8_SCORES 1
// Scores of an int8 pool in integers (head_dim a multiple of 64, CPUs with AVX-512 VNNI): each
// query head is quantized once an item to ~16 bits, x ~ dx * (254 q1 + q2) with q1, q2 int8 (the
// split the AVX2 WOQ kernel uses for activations: t = x * 127 / max|x|, q1 = round(t), q2 =
// round((t - q1) * 254), dx = max|x| / 32258), and q . k = dx * (254 q1 . k + q2 . k) is summed
// exactly in int32 by vpdpbusd (unsigned x signed bytes: the codes as k + 128, corrected by
// -128 * sum(q) once a head). 16 keys at a time: their rows of 64 codes are transposed so that
// each vector holds one group of 4 codes of all 16 keys, and the query's group is broadcast: no
// horizontal sums (the float loops spent a third of their work folding lanes). A score is then
// one rounding of the exact integer sum, times dx, times the key's scale.
struct QuantizedQuery {
  alignas(64) int32_t q1[256 / 4];  // d int8 codes, read 4 at a time
  alignas(64) int32_t q2[256 / 4];
  int32_t correction;  // 128 * (254 * sum(q1) + sum(q2))
  float dx;            // NaN where the row holds NaN or infinity
};

// Into L1: bytes [off, off + bytes) of the rows of slots rs[0..n) (rows of `row` bytes from
// base). Where the slots run consecutively (a request's own tokens) the rows lie in address order
// and the whole span from the first to the last is fetched, line by line; else row by row. The
// integer loops fetch the rows a block or two of 16 keys ahead of the ones they read, so that a
// thread reads memory as one stream in address order (an item's K rows, its V rows, then the next
// item's), which measured 1.25-1.6x the rate of passes over one kv head's lines at a time (a
// 192-byte stride for SmolLM2), however those passes spread their prefetches.
[[gnu::always_inline]] inline void prefetch_rows(const void* base, const int64_t* rs, int64_t n, int64_t row,
                                                 int64_t off, int64_t bytes) {
  if (n <= 0) return;
  const char* b = static_cast<const char*>(base) + off;
  auto span = [](const char* first, const char* last) {  // the lines of [first, last]
    // (an asm statement: GCC deletes a loop of a run-time count whose only statements are
    // _mm_prefetch, which it counts as no side effect)
    for (uintptr_t p = reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63}; p <= reinterpret_cast<uintptr_t>(last);
         p += 64)
      asm volatile("prefetcht0 %0" : : "m"(*reinterpret_cast<const char*>(p)));
  };
  if (rs[n - 1] - rs[0] == n - 1) {
    span(b + rs[0] * row, b + rs[n - 1] * row + bytes - 1);
  } else {
    for (int64_t u = 0; u < n; ++u) span(b + rs[u] * row, b + rs[u] * row + bytes - 1);
  }
}

// The first min(n, 16) lanes (n >= 0): a loop's last, partial vector.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1); }

// The largest |x[j]| of x[0..n), or NaN where one of them is NaN.
inline float abs_max_or_nan(const float* x, int64_t n) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_andnot_ps(sign, v));
  }
  if (j < n) {
    const __mmask16 tail = first_lanes(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(tail, x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_andnot_ps(sign, v));
  }
  return nan ? NAN : _mm512_reduce_max_ps(m);
}

// d floats (d <= 256, a multiple of 16) into one QuantizedQuery.
inline void quantize_query(const float* x, int64_t d, QuantizedQuery& out) {
  const float a = abs_max_or_nan(x, d);
  const bool finite = a < INFINITY;  // (false for NaN too)
  const __m512 inv = _mm512_set1_ps(finite && a > 0.f ? 127.f / a : 0.f);
  __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
  auto* q1 = reinterpret_cast<int8_t*>(out.q1);
  auto* q2 = reinterpret_cast<int8_t*>(out.q2);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t c = 0; c < d; c += 16) {
    const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x + c), inv);
    const __m512 r1 = _mm512_roundscale_ps(t, kNearest);
    const __m512 r2 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t, r1), _mm512_set1_ps(254.f)), kNearest);
    const __m512i i1 = _mm512_cvtps_epi32(r1), i2 = _mm512_cvtps_epi32(r2);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + c), _mm512_cvtepi32_epi8(i1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + c), _mm512_cvtepi32_epi8(i2));
    s1 = _mm512_add_epi32(s1, i1);
    s2 = _mm512_add_epi32(s2, i2);
  }
  out.correction = 128 * (254 * _mm512_reduce_add_epi32(s1) + _mm512_reduce_add_epi32(s2));
  out.dx = finite ? a / (127.f * 254.f) : NAN;
}

// In place: r[m] lane u = dword m of r[u] before (a 16 x 16 transpose of 32-bit words).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  // x[4 * f + m]: dwords m, m + 4, m + 8, m + 12 (one per 128-bit lane) of keys 4f .. 4f + 3
  __m512i x[16];
  for (int f = 0; f < 4; ++f) {
    const __m512i a0 = t[4 * f], b0 = t[4 * f + 1], a1 = t[4 * f + 2], b1 = t[4 * f + 3];
    x[4 * f] = _mm512_unpacklo_epi64(a0, a1);
    x[4 * f + 1] = _mm512_unpackhi_epi64(a0, a1);
    x[4 * f + 2] = _mm512_unpacklo_epi64(b0, b1);
    x[4 * f + 3] = _mm512_unpackhi_epi64(b0, b1);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i p = _mm512_shuffle_i32x4(x[m], x[4 + m], 0x44), q = _mm512_shuffle_i32x4(x[m], x[4 + m], 0xEE);
    const __m512i pz = _mm512_shuffle_i32x4(x[8 + m], x[12 + m], 0x44);
    const __m512i qz = _mm512_shuffle_i32x4(x[8 + m], x[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(p, pz, 0x88);
    r[m + 4] = _mm512_shuffle_i32x4(p, pz, 0xDD);
    r[m + 8] = _mm512_shuffle_i32x4(q, qz, 0x88);
    r[m + 12] = _mm512_shuffle_i32x4(q, qz, 0xDD);
  }
}

// The scores of one block of n <= 16 keys (slots rs[0..n)) against G query heads of kv head kh
// (qq: theirs): scores[i * stride + u] = q_i . k_u * kscale_u (key u's codes at kbase + rs[u] * row,
// kbase offset to kv head kh; its scale ks[rs[u] * hkv + kh]), and top[i] (16 lanes) raised to them;
// where vout is given, vout[u] = vs[rs[u] * hkv + kh] (its values' scales, read in the same pass).
template <int G, int DC>
inline void score_block_int8(const QuantizedQuery* qq, const int8_t* kbase, const float* ks, const float* vs,
                             float* vout, const ScaleRows& scale_rows, int64_t hkv, int64_t kh, const int64_t* rs,
                             int64_t n, int64_t row, float* scores, int64_t stride, float* top) {
  static_assert(DC % 64 == 0 && DC <= 256);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* kr[16];
  __m512 kv;
  const bool run = n == 16 && consecutive16(rs);
  if (run) {
    // slots s0 .. s0 + 15 (a request's own tokens usually are): rows at a fixed stride, scales
    // by ScaleRows
    kr[0] = kbase + rs[0] * row;  // (the others are kr[0] + u * row: pointers of a vector register cost extracts)
    kv = scale_rows.load(ks + rs[0] * hkv);
    if (vout) _mm512_storeu_ps(vout, scale_rows.load(vs + rs[0] * hkv));
  } else {
    alignas(64) float kscale[16];
    for (int u = 0; u < 16; ++u) {
      const int64_t j = std::min<int64_t>(u, n - 1);
      kr[u] = kbase + rs[j] * row;
      kscale[u] = ks[rs[j] * hkv + kh];
      if (vout && u < n) vout[u] = vs[rs[j] * hkv + kh];
    }
    kv = _mm512_load_ps(kscale);
  }
  __m512i a1[G], a2[G];
  for (int i = 0; i < G; ++i) a1[i] = a2[i] = _mm512_setzero_si512();
  for (int b = 0; b < DC / 64; ++b) {
    __m512i r[16];
    if (run) {
      const int8_t* k = kr[0] + 64 * b;
      for (int u = 0; u < 16; ++u, k += row) r[u] = _mm512_xor_si512(_mm512_loadu_si512(k), flip);
    } else {
      for (int u = 0; u < 16; ++u) r[u] = _mm512_xor_si512(_mm512_loadu_si512(kr[u] + 64 * b), flip);
    }
    transpose16(r);
    for (int m = 0; m < 16; ++m)
      for (int i = 0; i < G; ++i) {
        a1[i] = _mm512_dpbusd_epi32(a1[i], r[m], _mm512_set1_epi32(qq[i].q1[16 * b + m]));
        a2[i] = _mm512_dpbusd_epi32(a2[i], r[m], _mm512_set1_epi32(qq[i].q2[16 * b + m]));
      }
  }
  const __mmask16 keep = first_lanes(n);
  for (int i = 0; i < G; ++i) {
    // 254 * (q1 . k) + q2 . k, exact: |q1 . k| <= 256 * 128 * 127
    const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(a1[i], _mm512_set1_epi32(254)), a2[i]),
                                         _mm512_set1_epi32(qq[i].correction));
    const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qq[i].dx)), kv);
    _mm512_mask_storeu_ps(scores + i * stride, keep, s);
    float* t = top + 16 * i;
    _mm512_storeu_ps(t, _mm512_mask_max_ps(_mm512_loadu_ps(t), keep, _mm512_loadu_ps(t), s));
  }
}

// The softmax's weights of one query head, each times its value's scale, in place: s[j] <-
// exp(s[j] - m) * vscale[j] for j < len (m: the largest score). Returns the sum of the plain
// exp(s[j] - m) (the softmax's denominator) and sets *largest to the largest |s[j]| after, NaN
// where one is NaN (the value loops then fall back to floats). One pass, where the max, the
// exp and the scales each took one over the scores (a fifth of the kernel's work from L2).
inline float weigh_scores(float* s, const float* vscale, int64_t len, float m, float* largest) {
  const __m512 sign = _mm512_set1_ps(-0.f), vm = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps(), top = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 keep = first_lanes(len - j);
    const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j), vm)));
    total = _mm512_add_ps(total, e);
    const __m512 w = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(keep, vscale + j));
    nan |= _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, _mm512_andnot_ps(sign, w));
    _mm512_mask_storeu_ps(s + j, keep, w);
  }
  *largest = nan ? NAN : _mm512_reduce_max_ps(top);
  return _mm512_reduce_add_ps(total);
}


// acc + sum of a's and b's int16 pairs' products, lane by lane (vpdpwssd) with the accumulator
// updated in place: gcc 12 copies each accumulator of _mm512_dpwssd_epi32 twice an iteration in
// a rolled loop (24 register moves a key pair in the value loop below)
inline __m512i dpwssd_in_place(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// Head i's weights p[0..len) (times their values' scales) to 16 bits against their largest
// magnitude m (from weigh_scores, finite): w[j] = round(p[j] * 32767 / m) to nearest even (as
// std::nearbyint), |w[j]| <= 32767; w[len] = 0 where len is odd (the odd key's partner in the
// value loops' pairs: itself, weight 0). The weights' step, m / 65534, is ~2^-16 of the largest
// weight: within bfloat16's rounding of the output.
inline void quantize_weights(const float* p, int64_t len, float m, int16_t* w) {
  const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 keep = first_lanes(len - j);
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(keep, p + j), inv));
    _mm256_mask_storeu_epi16(w + j, keep, _mm512_cvtsepi32_epi16(q));
  }
  if (len % 2) w[len] = 0;
}

// acc[i] += sum_j wq[i][j] * v_j over keys j0 .. j0 + n - 1 (n even, or the item's last block;
// `last` the item's last key) for G query heads of one kv head over int8 value codes (head_dim DC,
// a multiple of 64), in integers: pairs of keys' codes, interleaved and widened to int16, are summed
// against the heads' 16-bit weights by vpdpwssd (two products a lane), exact in int32 over a chunk
// (256 * 32767 * 128 < 2^31). acc[i]: head i's DC / 16 vectors of int32 sums, vector 4 b + k
// holding 64-value block b's positions 64 b + kFirst[k] + 0..7 in lanes 0..7 and + 16..23 in
// lanes 8..15 (the unpacks' order; finish_values puts them in place).
constexpr int kFirst[4] = {0, 32, 8, 40};
template <int G, int DC>
inline void accumulate_block_int8(int16_t* const* wq, const int8_t* vbase, const int64_t* rs, int64_t j0, int64_t n,
                                  int64_t last, int64_t row, __m512i* const* acc) {
  static_assert(DC % 64 == 0 && DC <= 256);
  for (int b = 0; b < DC / 64; ++b) {
    __m512i o[G][4];
    for (int i = 0; i < G; ++i)
      for (int k = 0; k < 4; ++k) o[i][k] = _mm512_loadu_si512(acc[i] + 4 * b + k);
    for (int64_t j = j0; j < j0 + n; j += 2) {
      const int64_t j1 = std::min(j + 1, last);
      const __m512i a = _mm512_loadu_si512(vbase + rs[j] * row + 64 * b);
      const __m512i c = _mm512_loadu_si512(vbase + rs[j1] * row + 64 * b);
      const __m512i lo = _mm512_unpacklo_epi8(a, c), hi = _mm512_unpackhi_epi8(a, c);
      const __m512i x[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
                            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                            _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
                            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
      for (int i = 0; i < G; ++i) {
        int32_t wp;
        std::memcpy(&wp, wq[i] + j, 4);
        const __m512i w = _mm512_set1_epi32(wp);
        for (int k = 0; k < 4; ++k) o[i][k] = dpwssd_in_place(o[i][k], x[k], w);
      }
    }
    for (int i = 0; i < G; ++i)
      for (int k = 0; k < 4; ++k) _mm512_storeu_si512(acc[i] + 4 * b + k, o[i][k]);
  }
}

// out[c] = a head's int32 sums (accumulate_block_int8's order) times unit, in head_dim order.
inline void finish_values(const __m512i* sums, int64_t d, float unit, float* out) {
  const __m512 u = _mm512_set1_ps(unit);
  for (int64_t b = 0; b < d / 64; ++b)
    for (int k = 0; k < 4; ++k) {
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 4 * b + k)), u);
      float* lo8 = out + 64 * b + kFirst[k];
      _mm256_storeu_ps(lo8, _mm512_castps512_ps256(f));
      _mm256_storeu_ps(lo8 + 16, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    }
}
#endif

}  // namespace

bool attends_whole_rows(bool int8_pool, int64_t d) {
#ifdef SGRT_INT8_SCORES
  return int8_pool && d % 64 == 0 && d <= 256;
#else
  return false;
#endif
}

// Items ordered row, chunk, query heads; partials of split rows laid out row, chunk, kv head: row
// r's chunk c, kv head kh at first_part[r] + c * hkv + kh. An item is a (row, chunk, kv head) with
// its g query heads, or with whole_rows a (row, chunk) with all its query heads (the integer loops
// read its keys' whole rows block by block); where those items are fewer than 4 a thread and do
// not divide evenly among `threads` (SmolLM2's 3 kv heads on 2 threads: 2 : 1; Gemma 3's one:
// 1 : 0; whole rows of 1 or 3 chunks), a (row, chunk)'s query heads are cut into `threads`
// contiguous ranges instead (9: 5 + 4 heads, 4: 2 + 2), which may span kv heads: an item reads
// the key / value rows of its kv heads key by key, so a thread reads the slots' rows in order
// (the hardware prefetcher follows; per query head, as before, each thread re-read a kv head's
// keys once a head, ~3.5 GB/s from memory at 128 keys).
void plan_attention(AttendWork& w, int64_t b, int64_t h, int64_t hkv, int64_t d, const int64_t* ln, int64_t max_kv,
                    int64_t threads, bool whole_rows) {
  const int64_t g = h / hkv;
  w.g = g;
  w.hkv = hkv;
  w.d = d;
  w.span = std::min(max_kv, kDecodeChunk);
  w.part_size = g * (d + 2);
  w.items.clear();
  w.merges.clear();
  w.first_part.assign(b, -1);
  const int64_t per = whole_rows ? 1 : hkv;  // items a (row, chunk), unless cut into ranges
  int64_t base = 0;
  for (int64_t r = 0; r < b; ++r) base += (ln[r] + kDecodeChunk - 1) / kDecodeChunk * per;
  const bool ranges = threads > 1 && base % threads != 0 && base < 4 * threads;
  const int64_t cuts = ranges ? std::min(threads, h) : per;
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
  // the threads' shares cut by work (keys times query heads), not by items: a row's last chunk
  // is often short, and the thread holding it would wait for the other at the barrier
  int64_t total = 0;
  for (const AttendItem& it : w.items) total += it.n * (it.q1 - it.q0);
  w.shares.assign(threads + 1, static_cast<int64_t>(w.items.size()));
  w.shares[0] = 0;
  int64_t done = 0, t = 1;
  for (size_t i = 0; i < w.items.size() && t < threads; ++i) {
    const int64_t work = w.items[i].n * (w.items[i].q1 - w.items[i].q0);
    // item i goes to the thread whose share its middle falls in
    while (t < threads && 2 * done + work > 2 * total * t / threads) w.shares[t++] = static_cast<int64_t>(i);
    done += work;
  }
}

namespace {

#ifdef SGRT_INT8_SCORES
// Up to 4 query heads (indices among an item's) of kv head kh whose values are summed together.
struct HeadGroup {
  int64_t n, kh, head[4];
};
#endif

// Per-thread scratch of the attention items, grown and never shrunk.
struct AttendScratch {
  std::vector<float> qf, scores, acc, sums, maxes, scales;
  std::vector<int64_t> kv_of;
#ifdef SGRT_INT8_SCORES
  std::vector<QuantizedQuery> qq;
  std::vector<float> vscales, tops, largest;
  std::vector<int16_t> wq;
  std::vector<int32_t> sums32;
  std::vector<HeadGroup> groups;
#endif
};

AttendScratch& attend_scratch() {
  thread_local AttendScratch s;
  return s;
}

#ifdef SGRT_INT8_SCORES
// The rows of the item a thread works on next (its n slots rs[0..n), kv heads [kh0, kh1]); n = 0:
// none.
struct NextRows {
  const int64_t* rs;
  int64_t n, kh0, kh1;
};

// One item over an int8 pool, in integers (head_dim DC, a multiple of 64; AVX-512 VNNI): its gi
// query heads' scaled queries qf [gi, DC] (head i against kv head kv_of[i], ascending) over the
// keys at slots rs[0..len). Sets sums[i] and maxes[i] (the softmax's denominator and largest
// score) and acc [gi, DC] (the unnormalised output). Block by block of 16 keys, every kv head of
// the item in turn, so that the rows are read in address order, the next block's fetched ahead:
// the scores (and the scales), then the softmax's weights, then the values; then `next`'s first
// rows are fetched.
template <int DC>
void attend_item_int8(const AttendArgs& a, int64_t hkv, const float* qf, const int64_t* kv_of, int64_t gi,
                      const int64_t* rs, int64_t len, int64_t span, AttendScratch& sc, float* scores, float* sums,
                      float* maxes, float* acc, const NextRows& next, bool warm) {
  const int64_t row = hkv * DC, kh0 = kv_of[0], kh1 = kv_of[gi - 1];
  const int64_t bytes = (kh1 - kh0 + 1) * DC;  // the item's part of a row
  const auto* kp = static_cast<const int8_t*>(a.k);
  const auto* vp = static_cast<const int8_t*>(a.v);
  float* const vscales = at_least(sc.vscales, hkv * span);  // each kv head's V scales of the keys
  float* const tops = at_least(sc.tops, gi * 16);
  float* const largest = at_least(sc.largest, gi);
  const int64_t wstride = span + 2;  // (a head's 16-bit weights, an even count)
  int16_t* const wq = at_least(sc.wq, gi * wstride);
  auto* const sums32 = reinterpret_cast<__m512i*>(at_least(sc.sums32, gi * DC));  // each head's value sums
  if (static_cast<int64_t>(sc.qq.size()) < gi) sc.qq.resize(gi);
  for (int64_t i = 0; i < gi; ++i) quantize_query(qf + i * DC, DC, sc.qq[i]);
  std::fill(tops, tops + gi * 16, -INFINITY);
  auto runs = [&](auto&& f) { for_each_kv_run(kv_of, gi, f); };
  // The item's reads as one stream of blocks of 16 keys: its K blocks (rows and scales), its V
  // blocks, then the next item's K blocks (where this thread works on it); the block `ahead` on
  // is fetched while one is read: 2 blocks where a block's rows take at most 4 KB (SmolLM2's 3 KB:
  // as fast as or faster than 1, 3 or 5 blocks here), else 1 (8 kv heads of 128 take 16 KB).
  const int64_t ahead = 16 * bytes <= 4096 ? 2 : 1;
  const int64_t nb = (len + 15) / 16;
  // a K block: the rows' codes and K / V scales of slots s[0..m), kv heads [first, last]
  auto fetch_keys = [&](const int64_t* s, int64_t m, int64_t first, int64_t last) {
    const int64_t heads = last - first + 1;
    prefetch_rows(kp, s, m, row, first * DC, heads * DC);
    prefetch_rows(a.ks, s, m, hkv * 4, first * 4, heads * 4);
    prefetch_rows(a.vs, s, m, hkv * 4, first * 4, heads * 4);
  };
  auto fetch = [&](int64_t x) {
    if (x < nb) {
      fetch_keys(rs + 16 * x, std::min<int64_t>(16, len - 16 * x), kh0, kh1);
    } else if (x < 2 * nb) {
      x -= nb;
      prefetch_rows(vp, rs + 16 * x, std::min<int64_t>(16, len - 16 * x), row, kh0 * DC, bytes);
    } else if (16 * (x - 2 * nb) < next.n) {
      // (the next item's slots are checked when it starts: a bad one is not fetched from here)
      const int64_t* s = next.rs + 16 * (x - 2 * nb);
      const int64_t m = std::min<int64_t>(16, next.n - 16 * (x - 2 * nb));
      for (int64_t u = 0; u < m; ++u)
        if (s[u] < 0 || s[u] >= a.num_slots) return;
      fetch_keys(s, m, next.kh0, next.kh1);
    }
  };
  if (!warm)
    for (int64_t x = 1; x < ahead; ++x) fetch(x);
  // the scores, each times its key's scale
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - j0);
    fetch(j0 / 16 + ahead);
    runs([&](int64_t i, int64_t e, int64_t kh) {
      const ScaleRows scale_rows(hkv, kh);
      for (int64_t f = i; f < e; f += 4) {
        // (the first group of a kv head also reads its values' scales)
        float* vo = f == i ? vscales + kh * span + j0 : nullptr;
        const QuantizedQuery* q = sc.qq.data() + f;
        const int8_t* kb = kp + kh * DC;
        float* so = scores + f * span + j0;
        float* t = tops + f * 16;
        switch (std::min<int64_t>(4, e - f)) {
          case 4:
            score_block_int8<4, DC>(q, kb, a.ks, a.vs, vo, scale_rows, hkv, kh, rs + j0, n, row, so, span, t);
            break;
          case 3:
            score_block_int8<3, DC>(q, kb, a.ks, a.vs, vo, scale_rows, hkv, kh, rs + j0, n, row, so, span, t);
            break;
          case 2:
            score_block_int8<2, DC>(q, kb, a.ks, a.vs, vo, scale_rows, hkv, kh, rs + j0, n, row, so, span, t);
            break;
          default:
            score_block_int8<1, DC>(q, kb, a.ks, a.vs, vo, scale_rows, hkv, kh, rs + j0, n, row, so, span, t);
            break;
        }
      }
    });
  }
  // the weights, each times its value's scale, and their 16-bit codes
  runs([&](int64_t i, int64_t e, int64_t kh) {
    for (; i < e; ++i) {
      maxes[i] = _mm512_reduce_max_ps(_mm512_loadu_ps(tops + i * 16));
      sums[i] = weigh_scores(scores + i * span, vscales + kh * span, len, maxes[i], largest + i);
      if (largest[i] < INFINITY) quantize_weights(scores + i * span, len, largest[i], wq + i * wstride);
    }
  });
  // the values: the heads whose weights are finite, in groups of at most 4 of one kv head
  std::vector<HeadGroup>& groups = sc.groups;
  groups.clear();
  runs([&](int64_t i, int64_t e, int64_t kh) {
    HeadGroup gr{0, kh, {}};
    for (; i < e; ++i) {
      if (!(largest[i] < INFINITY)) continue;
      gr.head[gr.n++] = i;
      if (gr.n == 4) {
        groups.push_back(gr);
        gr.n = 0;
      }
    }
    if (gr.n > 0) groups.push_back(gr);
  });
  std::fill(reinterpret_cast<int32_t*>(sums32), reinterpret_cast<int32_t*>(sums32) + gi * DC, 0);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - j0);
    fetch(nb + j0 / 16 + ahead);
    for (const HeadGroup& gr : groups) {
      int16_t* w[4];
      __m512i* o[4];
      for (int64_t u = 0; u < gr.n; ++u) {
        w[u] = wq + gr.head[u] * wstride;
        o[u] = sums32 + gr.head[u] * (DC / 16);
      }
      const int8_t* vb = vp + gr.kh * DC;
      switch (gr.n) {
        case 4: accumulate_block_int8<4, DC>(w, vb, rs, j0, n, len - 1, row, o); break;
        case 3: accumulate_block_int8<3, DC>(w, vb, rs, j0, n, len - 1, row, o); break;
        case 2: accumulate_block_int8<2, DC>(w, vb, rs, j0, n, len - 1, row, o); break;
        default: accumulate_block_int8<1, DC>(w, vb, rs, j0, n, len - 1, row, o); break;
      }
    }
  }
  runs([&](int64_t i, int64_t e, int64_t kh) {
    for (; i < e; ++i) {
      if (largest[i] < INFINITY) {
        finish_values(sums32 + i * (DC / 16), DC, largest[i] / 32767.f, acc + i * DC);
      } else {
        // weights not finite: the float loops (NaN for NaN, as the softmax's own steps give)
        const int64_t zero = 0;
        std::fill(acc + i * DC, acc + (i + 1) * DC, 0.f);
        accumulate_values<int8_t, DC>(scores + i * span, 1, DC, vp + kh * DC, &zero, rs, len, row, span,
                                      acc + i * DC);
      }
    }
  });
}
#endif

// Items [begin, end) of w. DC: head_dim known at compile time (64, 128, 256: AVX-512 paths whose loops
// over it unroll), or 0 for any other head_dim (portable loops). KR: the caches' raw type, R (q's) or
// int8_t (an int8 pool: a.ks / a.vs its scales). Returns false, with *bad_slot set to a slot outside
// [0, num_slots), if it met one (nothing of a bad item is read, and out is left partly unwritten).
template <typename T, typename KR, int DC>
bool attend_items(const AttendArgs& a, AttendWork& w, int64_t begin, int64_t end, int64_t* bad_slot) {
  using R = raw<T>;
  constexpr bool kInt8 = std::is_same_v<KR, int8_t>;
  const int64_t d = DC > 0 ? DC : w.d;
  const int64_t g = w.g, hkv = w.hkv, h = g * hkv, span = w.span, row = hkv * d;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const R* qp = static_cast<const R*>(a.q);
  const KR* kp = static_cast<const KR*>(a.k);
  const KR* vp = static_cast<const KR*>(a.v);
  R* op = static_cast<R*>(a.out);
  AttendScratch& sc = attend_scratch();
  float* const qf = at_least(sc.qf, h * d);
  float* const scores = at_least(sc.scores, h * span);
  float* const acc = at_least(sc.acc, h * d);
  float* const sums = at_least(sc.sums, h);
  float* const maxes = at_least(sc.maxes, h);
  int64_t* const kv_of = at_least(sc.kv_of, h);
  float* const kv_scales = kInt8 ? at_least(sc.scales, span) : nullptr;  // (an int8 pool's scales of one kv head)
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
    auto runs = [&](auto&& f) { for_each_kv_run(kv_of, gi, f); };
#ifdef SGRT_INT8_SCORES
    constexpr bool kIntScores = kInt8 && DC > 0 && DC % 64 == 0;
#else
    constexpr bool kIntScores = false;
#endif
    if constexpr (kIntScores) {
#ifdef SGRT_INT8_SCORES
      // this thread's next item's first rows, fetched at the end of this one
      NextRows next{nullptr, 0, 0, 0};
      if (it + 1 < end) {
        const AttendItem& n = w.items[it + 1];
        next = {a.sl + n.r * a.max_kv + n.c0, n.n, n.q0 / g, (n.q1 - 1) / g};
      }
      attend_item_int8<DC>(a, hkv, qf, kv_of, gi, rs, len, span, sc, scores, sums, maxes, acc, next, it > begin);
#endif
    } else {
      if (blocked) {
#ifdef SGRT_BLOCKED_ATTENTION
        runs([&](int64_t i, int64_t e, int64_t kh) {
          // kv head 0's run prefetches the whole rows (its chunk's other kv heads, next in this
          // thread's work, then find theirs in cache)
          const bool whole = kh == 0;
          score_keys_blocked<KR, BDC>(qf + i * d, e - i, d, kp + kh * d, rs, len, row, scores + i * span, span,
                                      whole ? kp : kp + kh * d, whole ? vp : vp + kh * d, whole ? row : d);
        });
#endif
      } else {
        score_keys<KR, DC>(qf, gi, d, kp, kv_of, rs, len, row, scores, span);
      }
      // an int8 pool: each kv head's scales of the item's keys gathered once through the slot table
      // (for all its query heads), and row i's values x[j] multiplied by them
      // rows [i, e) of x times by[0..len)
      auto multiply_rows = [&](int64_t i, int64_t e, const float* by, float* x) {
        for (; i < e; ++i) {
          float* xi = x + i * span;
#pragma omp simd
          for (int64_t j = 0; j < len; ++j) xi[j] *= by[j];
        }
      };
      auto scale_rows = [&](const float* all, float* x) {
        runs([&](int64_t i, int64_t e, int64_t kh) {
          gather_scales(all + kh, hkv, rs, len, kv_scales);
          multiply_rows(i, e, kv_scales, x);
        });
      };
      if constexpr (kInt8) scale_rows(a.ks, scores);  // the scores of codes times their keys' scales
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
      if constexpr (kInt8) scale_rows(a.vs, scores);  // each weight times its value's scale (sums: the plain weights)
      std::fill(acc, acc + gi * d, 0.f);
      if (blocked) {
#ifdef SGRT_BLOCKED_ATTENTION
        runs([&](int64_t i, int64_t e, int64_t kh) {
          accumulate_values_blocked<KR, BDC>(scores + i * span, e - i, d, vp + kh * d, rs, len, row, span,
                                             acc + i * d);
        });
#endif
      } else {
        accumulate_values<KR, DC>(scores, gi, d, vp, kv_of, rs, len, row, span, acc);
      }
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

}  // namespace

// This thread's share, part of parts, of w's items (merges: of its merges), q's dtype and
// head_dim chosen here. Returns false with *bad_slot set as attend_items does.
bool attend_share(at::ScalarType dtype, const AttendArgs& a, AttendWork& w, bool merges, int64_t part, int64_t parts,
                  int64_t* bad_slot) {
  const int64_t n = static_cast<int64_t>(merges ? w.merges.size() : w.items.size());
  const bool by_work = !merges && static_cast<int64_t>(w.shares.size()) == parts + 1;
  const int64_t begin = by_work ? w.shares[part] : n * part / parts;
  const int64_t end = by_work ? w.shares[part + 1] : n * (part + 1) / parts;
  bool ok = true;
  auto items = [&]<typename scalar_t, typename KR>() {
    if (w.d == 64) {
      ok = attend_items<scalar_t, KR, 64>(a, w, begin, end, bad_slot);
    } else if (w.d == 128) {
      ok = attend_items<scalar_t, KR, 128>(a, w, begin, end, bad_slot);
    } else if (w.d == 256) {  // (Gemma 3)
      ok = attend_items<scalar_t, KR, 256>(a, w, begin, end, bad_slot);
    } else {
      ok = attend_items<scalar_t, KR, 0>(a, w, begin, end, bad_slot);
    }
  };
  dispatch_float(dtype, [&]<typename scalar_t>() {
    if (merges) {
      merge_items<scalar_t>(a, w, begin, end);
    } else if (a.ks != nullptr) {
      items.template operator()<scalar_t, int8_t>();
    } else {
      items.template operator()<scalar_t, raw<scalar_t>>();
    }
  });
  return ok;
}

// decode_attention's checks on the caches and slot tables, for a q of b rows of h heads of d values
// in `dtype` (the plan runs them once a step, for every layer, before its thread team starts).
void check_cache_and_tables(const Tensor& k_cache, const Tensor& v_cache, at::ScalarType dtype, int64_t b, int64_t h,
                            int64_t d, const Tensor& slots, const Tensor& kv_lens, const Tensor* k_scale,
                            const Tensor* v_scale) {
  TORCH_CHECK((k_scale == nullptr) == (v_scale == nullptr), "give k_scale and v_scale both or neither");
  const auto cache_dtype = k_scale ? at::kChar : dtype;
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == cache_dtype &&
                  v_cache.scalar_type() == cache_dtype,
              "k_cache and v_cache must be contiguous [slots, kv_heads, head_dim] in q's dtype (int8 with scales)");
  if (k_scale) {
    for (const Tensor* s : {k_scale, v_scale}) {
      TORCH_CHECK(s->dim() == 2 && s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) &&
                      s->is_contiguous() && s->scalar_type() == at::kFloat,
                  "k_scale and v_scale must be contiguous float32 [slots, kv_heads] beside int8 caches");
    }
  }
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
                       const Tensor& slots, const Tensor& kv_lens, Tensor& out, const Tensor* k_scale,
                       const Tensor* v_scale) {
  return {q, qs0, qs1, k_cache.const_data_ptr(), v_cache.const_data_ptr(), k_cache.size(0),
          slots.const_data_ptr<int64_t>(), kv_lens.const_data_ptr<int64_t>(), slots.size(1), out.data_ptr(),
          k_scale ? k_scale->const_data_ptr<float>() : nullptr, v_scale ? v_scale->const_data_ptr<float>() : nullptr};
}

// out: a [B, H * D] buffer of q's dtype to write into, or undefined.
Tensor decode_attention_into(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                             const Tensor& kv_lens, Tensor out, const Tensor* k_scale, const Tensor* v_scale) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, heads, head_dim] with a contiguous last dim");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  Tensor lens = kv_lens.contiguous();
  check_cache_and_tables(k_cache, v_cache, q.scalar_type(), b, h, d, slots, lens, k_scale, v_scale);
  out = out.defined() ? out : at::empty({b, h * d}, q.options());
  const AttendArgs a =
      attend_args(q.const_data_ptr(), q.stride(0), q.stride(1), k_cache, v_cache, slots, lens, out, k_scale, v_scale);
  thread_local AttendWork own;  // (its vectors reused call to call)
  AttendWork& w = own;  // (a lambda naming a thread_local would read the running thread's own one)
  const int64_t threads = at::get_num_threads();
  plan_attention(w, b, h, k_cache.size(1), d, a.ln, a.max_kv, threads, attends_whole_rows(k_scale != nullptr, d));
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
                        const Tensor& kv_lens, const std::optional<Tensor>& k_scale,
                        const std::optional<Tensor>& v_scale) {
  return decode_attention_into(q, k_cache, v_cache, slots, kv_lens, Tensor(), opt_ptr(k_scale), opt_ptr(v_scale));
}

}  // namespace sgrt_layer
