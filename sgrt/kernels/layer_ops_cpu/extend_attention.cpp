// Extend (prefill) attention over the KV pool (torch.ops.sgrt_layer.extend_attention): rows of
// q_len > 1 new queries after a cached prefix, bfloat16 q and caches, keys and values read from
// their pool slots (no gathered copy, no padding, no mask tensor).
//
// Why: torch's CPU flash attention runs its bfloat16 matmuls through MKL's bf16 GEMM, which on
// CPUs without AMX (AMD Zen 4) widens to float32 and runs a generic sgemm (~95 GFLOP/s on the
// 2-core Zen 4). AVX-512 BF16's vdpbf16ps (_mm512_dpbf16_ps: 16 lanes, each adding two bfloat16
// products to its float32 accumulator) does them natively: a oneDNN bfloat16 matmul, which uses
// it, reaches ~400 GFLOP/s there.
//
// Arithmetic (what torch's CPU flash attention does for bfloat16, with other block sizes):
// - scores: q . k as float32 sums of the exact products of bfloat16 values (vdpbf16ps; inputs
//   that are bfloat16 denormals count as zero, as in that instruction), times 1 / sqrt(D) in
//   float32;
// - softmax: online, over blocks of kKeyBlock keys (Dao et al., "FlashAttention-2", 2023,
//   arXiv:2307.08691, algorithm 1): per query a running max m and sum l, in float32; each
//   block's weights p = exp(s - m_new) (exp16: fast_exp's steps, 16 lanes), l = l * exp(m_old -
//   m_new) + sum(p) with p unrounded, the output accumulator rescaled by exp(m_old - m_new);
// - P @ V: p rounded to bfloat16, then vdpbf16ps into the float32 accumulator;
// - output: accumulator times 1 / l, rounded to bfloat16 once.
//
// Layout: a pre-pass packs each row's keys and values, per kv head and block of kKeyBlock keys,
// into a scratch buffer: K as [D / 2][kKeyBlock][2] (a key's bfloat16 pairs, one 32-bit word a
// pair, keys side by side), so one vdpbf16ps with a query's pair broadcast gives 16 keys'
// partial scores (no horizontal sums); V as [kKeyBlock / 2][D][2] (two keys' values of one
// column side by side), so one vdpbf16ps with a query's two weights broadcast adds two keys to 16
// output columns. Keys past a row's context in its last block are packed as zeros (their weights
// are 0; a zero value keeps 0 * garbage from making a NaN).
//
// Work: items (row, kv head, block of query positions), each the g query heads of that kv head
// at those positions (they share the kv head's packed keys: grouped-query attention, Ainslie et
// al., arXiv:2305.13245), register-blocked kTileRows query rows at a time. The items and each
// item's order of sums depend only on the shapes, not on the thread count; threads take items
// from a shared counter (largest first), so which thread computes an item changes, not its bits:
// the output is bitwise the same on any number of threads.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define SGRT_EXTEND_ATTENTION 1
#include <immintrin.h>
#endif

#include "attention.h"
#include "extend_attention.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

bool extend_attention_supported() {
#ifdef SGRT_EXTEND_ATTENTION
  return true;
#else
  return false;
#endif
}

#ifdef SGRT_EXTEND_ATTENTION
namespace {

constexpr int64_t kKeyBlock = 64;   // keys a block: 4 vectors of 16 keys
constexpr int64_t kItemRows = 96;   // query rows (positions x heads of one kv head) an item, about
constexpr int kTileRows = 4;        // query rows a register tile (4 x 4 float32 accumulators)
constexpr int kKeyVectors = kKeyBlock / 16;

// One row of the call: its queries at q rows [t0, t0 + q_len), its context of kv_len keys in
// `blocks` blocks, packed at `pack` (uint16 offset of kv head 0; kv head kh at + kh * blocks * kKeyBlock * D).
struct ExtendRow {
  int64_t t0, q_len, kv_len, blocks, pack;
};

// Query positions [i0, i1) of row r (0-based among its new ones), the g heads of kv head kh;
// `cost`: rows x key blocks (for the largest-first order).
struct ExtendItem {
  int64_t r, kh, i0, i1, cost;
};

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, sizeof(u));
  return u;
}

// x[i][c] <- x[c][i]: a 16 x 16 matrix of 32-bit words in 16 registers, transposed: words
// interleaved by 32 then 64 bits (4 x 4 blocks within each 128-bit lane), then the lanes moved.
inline void transpose16(__m512i* x) {
  __m512i a[16], b[16];
  for (int k = 0; k < 16; k += 2) {
    a[k] = _mm512_unpacklo_epi32(x[k], x[k + 1]);
    a[k + 1] = _mm512_unpackhi_epi32(x[k], x[k + 1]);
  }
  // b[4q + e], lane L: rows 4q..4q+3 of column 4L + e
  for (int q = 0; q < 16; q += 4) {
    b[q] = _mm512_unpacklo_epi64(a[q], a[q + 2]);
    b[q + 1] = _mm512_unpackhi_epi64(a[q], a[q + 2]);
    b[q + 2] = _mm512_unpacklo_epi64(a[q + 1], a[q + 3]);
    b[q + 3] = _mm512_unpackhi_epi64(a[q + 1], a[q + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i u0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), u1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
    x[e] = _mm512_shuffle_i32x4(u0, u2, 0x88);       // column e: lane 0 of each
    x[4 + e] = _mm512_shuffle_i32x4(u0, u2, 0xDD);   // column 4 + e: lane 1
    x[8 + e] = _mm512_shuffle_i32x4(u1, u3, 0x88);   // lane 2
    x[12 + e] = _mm512_shuffle_i32x4(u1, u3, 0xDD);  // lane 3
  }
}

// Packs keys [blk * kKeyBlock, +kKeyBlock) of a row (slots rs, kv_len keys) for every kv head:
// K into kp, V into vp (the layouts of the top; kv head kh's block at + (kh * blocks + blk) *
// kKeyBlock * D). False, *bad set, where a slot is outside [0, num_slots) (nothing of it read).
template <int D>
bool pack_block(const uint16_t* k, const uint16_t* v, int64_t num_slots, int64_t hkv, const int64_t* rs,
                int64_t kv_len, int64_t blocks, int64_t blk, uint16_t* kp, uint16_t* vp, int64_t* bad) {
  const int64_t j0 = blk * kKeyBlock, n = std::min(kKeyBlock, kv_len - j0);
  for (int64_t j = 0; j < n; ++j) {
    if (rs[j0 + j] < 0 || rs[j0 + j] >= num_slots) {
      *bad = rs[j0 + j];
      return false;
    }
  }
  constexpr int64_t kBlockSize = kKeyBlock * D;
  // indices of permutex2var_epi16 interleaving 32 columns of two keys a, b: a0 b0 a1 b1 ... (lo:
  // columns 0-15, hi: 16-31); index bit 5 picks b
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                  8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t kh = 0; kh < hkv; ++kh) {
    uint32_t* kb = reinterpret_cast<uint32_t*>(kp + (kh * blocks + blk) * kBlockSize);  // [D / 2][kKeyBlock]
    uint16_t* vb = vp + (kh * blocks + blk) * kBlockSize;                                 // [kKeyBlock / 2][D][2]
    // 16 keys x 16 pairs at a time: rows loaded, transposed in registers, stored as columns
    for (int64_t j = 0; j < kKeyBlock; j += 16) {
      for (int64_t c = 0; c < D / 2; c += 16) {
        __m512i x[16];
        for (int i = 0; i < 16; ++i)
          x[i] = j + i < n ? _mm512_loadu_si512(k + (rs[j0 + j + i] * hkv + kh) * D + 2 * c) : _mm512_setzero_si512();
        transpose16(x);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kb + (c + i) * kKeyBlock + j, x[i]);
      }
    }
    for (int64_t j = 0; j < kKeyBlock; j += 2) {
      uint16_t* dst = vb + j / 2 * D * 2;
      if (j >= n) {
        std::memset(dst, 0, D * 2 * sizeof(uint16_t));
        continue;
      }
      const uint16_t* a = v + (rs[j0 + j] * hkv + kh) * D;
      const bool has_b = j + 1 < n;
      const uint16_t* b = has_b ? v + (rs[j0 + j + 1] * hkv + kh) * D : nullptr;
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i va = _mm512_loadu_si512(a + c);
        const __m512i vb2 = has_b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(va, lo, vb2));
        _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(va, hi, vb2));
      }
    }
  }
  return true;
}

// s[r * kKeyBlock + j] = q_r . k_j (float32, unscaled) for MR query rows (qrow: each row's D
// bfloat16 values) against a packed key block kb ([D / 2][kKeyBlock][2]). Each score is one
// lane's vdpbf16ps chain over the pairs in order.
template <int MR, int D>
inline void score_tile(const uint16_t* const* qrow, const uint16_t* kb, float* s) {
  constexpr int NV = kKeyBlock / 16;
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int c = 0; c < D / 2; ++c) {
    __m512bh kv[NV];
    for (int u = 0; u < NV; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(kb + (c * kKeyBlock + 16 * u) * 2);
    for (int r = 0; r < MR; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(qrow[r] + 2 * c)));
      for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], qv, kv[u]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(s + r * kKeyBlock + 16 * u, acc[r][u]);
}

// o[r] = o[r] * alpha[r] + sum_j p[r, j] v_j for MR rows (p: [MR][kKeyBlock] bfloat16 weights;
// vb: a packed value block [kKeyBlock / 2][D][2]; o: [MR][D] float32), 64 columns a pass. Each
// output value is one lane's chain: the rescale, then the key pairs in order.
template <int MR, int D>
inline void value_tile(const uint16_t* p, const uint16_t* vb, float* o, const float* alpha) {
  for (int c0 = 0; c0 < D; c0 += 64) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c0 + 16 * u), a);
    }
    for (int j = 0; j < kKeyBlock / 2; ++j) {
      __m512bh vv[4];
      for (int u = 0; u < 4; ++u) vv[u] = (__m512bh)_mm512_loadu_si512(vb + (j * D + c0 + 16 * u) * 2);
      for (int r = 0; r < MR; ++r) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(p + r * kKeyBlock + 2 * j)));
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], pv, vv[u]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o + r * D + c0 + 16 * u, acc[r][u]);
  }
}

// Per-thread scratch of the items, grown and never shrunk.
struct ExtendScratch {
  std::vector<float> s, o, m, l, alpha;
  std::vector<uint16_t> p;
  std::vector<const uint16_t*> qrow;
  std::vector<int64_t> pos;
};


// The arguments every item reads.
struct ExtendCall {
  const uint16_t* q;
  int64_t qs0, qs1;
  int64_t g, hkv;
  const uint16_t* kpack;
  const uint16_t* vpack;
  uint16_t* out;  // [T, H * D]
};

// One item: the online softmax over the key blocks its last position reaches.
template <int D>
void run_item(const ExtendCall& c, const ExtendRow& row, const ExtendItem& it, ExtendScratch& sc) {
  const int64_t g = c.g, h = g * c.hkv, m_rows = (it.i1 - it.i0) * g;
  const __m512 vscale = _mm512_set1_ps(1.f / std::sqrt(static_cast<float>(D)));
  float* const s = at_least(sc.s, m_rows * kKeyBlock);
  uint16_t* const p = at_least(sc.p, m_rows * kKeyBlock);
  float* const o = at_least(sc.o, m_rows * D);
  float* const mx = at_least(sc.m, m_rows);
  float* const l = at_least(sc.l, m_rows);
  float* const alpha = at_least(sc.alpha, m_rows);
  const uint16_t** const qrow = at_least(sc.qrow, m_rows);
  int64_t* const pos = at_least(sc.pos, m_rows);
  // query row m: position i0 + m / g of the row, head kh * g + m % g
  const int64_t first = row.kv_len - row.q_len;  // position of the row's first new query
  for (int64_t m = 0; m < m_rows; ++m) {
    const int64_t i = it.i0 + m / g;
    qrow[m] = c.q + (row.t0 + i) * c.qs0 + (it.kh * g + m % g) * c.qs1;
    pos[m] = first + i;
    mx[m] = -INFINITY;
    l[m] = 0.f;
  }
  std::fill(o, o + m_rows * D, 0.f);
  const int64_t blocks = (first + it.i1 - 1) / kKeyBlock + 1;  // the blocks the last position reaches
  const int64_t block_size = kKeyBlock * D;
  const uint16_t* kbase = c.kpack + row.pack + it.kh * row.blocks * block_size;
  const uint16_t* vbase = c.vpack + row.pack + it.kh * row.blocks * block_size;
  auto tiles = [&](auto&& f) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += kTileRows) {
      switch (std::min<int64_t>(kTileRows, m_rows - m0)) {
        case 4: f(std::integral_constant<int, 4>(), m0); break;
        case 3: f(std::integral_constant<int, 3>(), m0); break;
        case 2: f(std::integral_constant<int, 2>(), m0); break;
        default: f(std::integral_constant<int, 1>(), m0); break;
      }
    }
  };
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint16_t* kb = kbase + blk * block_size;
    tiles([&](auto mr, int64_t m0) { score_tile<decltype(mr)::value, D>(qrow + m0, kb, s + m0 * kKeyBlock); });
    for (int64_t m = 0; m < m_rows; ++m) {
      // keys [0, n) of the block are visible to this query (its position and those before it)
      const int64_t n = std::clamp<int64_t>(pos[m] - blk * kKeyBlock + 1, 0, kKeyBlock);
      float* sm = s + m * kKeyBlock;
      uint16_t* pm = p + m * kKeyBlock;
      if (n == 0) {  // (a query of the block's first positions, before this diagonal block)
        alpha[m] = 1.f;
        std::fill(pm, pm + kKeyBlock, uint16_t{0});
        continue;
      }
      // scaled scores, keys past n at -inf (lanes off in `on`)
      __m512 x[kKeyVectors];
      __mmask16 on[kKeyVectors];
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int u = 0; u < kKeyVectors; ++u) {
        const int64_t lanes = std::clamp<int64_t>(n - 16 * u, 0, 16);
        on[u] = static_cast<__mmask16>((1u << lanes) - 1u);
        x[u] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), on[u], _mm512_loadu_ps(sm + 16 * u), vscale);
        vmax = _mm512_max_ps(vmax, x[u]);
      }
      const float m_new = std::max(mx[m], _mm512_reduce_max_ps(vmax));
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int u = 0; u < kKeyVectors; ++u) {
        x[u] = _mm512_maskz_mov_ps(on[u], exp16(_mm512_sub_ps(x[u], vm)));
        sum = _mm512_add_ps(sum, x[u]);
      }
      for (int u = 0; u < kKeyVectors; u += 2)  // 32 weights rounded to bfloat16 (nearest even)
        _mm512_storeu_si512(pm + 16 * u, (__m512i)_mm512_cvtne2ps_pbh(x[u + 1], x[u]));
      const float total = _mm512_reduce_add_ps(sum);
      alpha[m] = fast_exp(mx[m] - m_new);  // (exp(-inf) on the first block: ~1e-38 times l = 0 and o = 0)
      l[m] = l[m] * alpha[m] + total;
      mx[m] = m_new;
    }
    const uint16_t* vb = vbase + blk * block_size;
    tiles([&](auto mr, int64_t m0) {
      value_tile<decltype(mr)::value, D>(p + m0 * kKeyBlock, vb, o + m0 * D, alpha + m0);
    });
  }
  for (int64_t m = 0; m < m_rows; ++m) {
    const int64_t i = it.i0 + m / g;
    uint16_t* dst = c.out + (row.t0 + i) * h * D + (it.kh * g + m % g) * D;
    const float inv = 1.f / l[m];
    const float* om = o + m * D;
#pragma omp simd
    for (int64_t e = 0; e < D; ++e) dst[e] = sgrt::bf16::from_float(om[e] * inv);
  }
}

template <int D>
void extend_attention_run(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                          const int64_t* ln, const int64_t* qn, Tensor& out) {
  const int64_t b = slots.size(0), max_kv = slots.size(1), h = q.size(1), hkv = k_cache.size(1);
  const int64_t g = h / hkv, num_slots = k_cache.size(0), block_size = kKeyBlock * D;
  std::vector<ExtendRow> rows(b);
  int64_t t0 = 0, pack = 0;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t blocks = (ln[r] + kKeyBlock - 1) / kKeyBlock;
    rows[r] = {t0, qn[r], ln[r], blocks, pack};
    t0 += qn[r];
    pack += hkv * blocks * block_size;
  }
  // the scratch of the packed keys and values, the calling thread's, reused call to call
  thread_local std::vector<uint16_t> kpack, vpack;
  uint16_t* const kp = at_least(kpack, pack);
  uint16_t* const vp = at_least(vpack, pack);
  // pre-pass units: (row, key block), all kv heads
  std::vector<std::pair<int64_t, int64_t>> units;
  for (int64_t r = 0; r < b; ++r)
    for (int64_t blk = 0; blk < rows[r].blocks; ++blk) units.emplace_back(r, blk);
  // items: (row, block of query positions, kv head), largest first (ties in this order)
  const int64_t positions = std::max<int64_t>(1, kItemRows / g);
  std::vector<ExtendItem> items;
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t i0 = 0; i0 < qn[r]; i0 += positions) {
      const int64_t i1 = std::min(qn[r], i0 + positions);
      const int64_t blocks = (ln[r] - qn[r] + i1 - 1) / kKeyBlock + 1;
      for (int64_t kh = 0; kh < hkv; ++kh) items.push_back({r, kh, i0, i1, (i1 - i0) * blocks});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const ExtendItem& x, const ExtendItem& y) { return x.cost > y.cost; });

  const int64_t threads = at::get_num_threads();
  const uint16_t* k = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr());
  const uint16_t* v = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr());
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  std::vector<int64_t> bad(threads, 0);
  std::vector<uint8_t> is_bad(threads, 0);
  const int64_t nu = static_cast<int64_t>(units.size());
  at::parallel_for(0, threads, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t t = p0; t < p1; ++t) {
      for (int64_t u = nu * t / threads; u < nu * (t + 1) / threads; ++u) {
        const auto [r, blk] = units[u];
        if (!pack_block<D>(k, v, num_slots, hkv, sl + r * max_kv, ln[r], rows[r].blocks, blk, kp + rows[r].pack,
                           vp + rows[r].pack, &bad[t]))
          is_bad[t] = 1;
      }
    }
  });
  for (int64_t t = 0; t < threads; ++t)
    TORCH_CHECK(!is_bad[t], "slot ", bad[t], " outside the pool's ", num_slots, " slots");

  const ExtendCall call{reinterpret_cast<const uint16_t*>(q.const_data_ptr()),
                        q.stride(0),
                        q.stride(1),
                        g,
                        hkv,
                        kp,
                        vp,
                        reinterpret_cast<uint16_t*>(out.data_ptr())};
  std::atomic<int64_t> next{0};
  const int64_t ni = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local ExtendScratch sc;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < ni;)
      run_item<D>(call, rows[items[i].r], items[i], sc);
  });
}

}  // namespace
#endif

Tensor extend_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                        const Tensor& kv_lens, const Tensor& q_lens) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16, "q must be a bfloat16 CPU tensor, got ",
              q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, heads, head_dim] with a contiguous last dim");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "head_dim must be 64, 128 or 256, got ", d);
  TORCH_CHECK(slots.dim() == 2, "slots must be contiguous int64 [B, max_kv]");
  const int64_t b = slots.size(0);
  check_cache_and_tables(k_cache, v_cache, at::kBFloat16, b, h, d, slots, kv_lens);
  TORCH_CHECK(q_lens.scalar_type() == at::kLong && q_lens.dim() == 1 && q_lens.size(0) == b && q_lens.is_contiguous(),
              "q_lens must be contiguous int64 [B]");
  const int64_t* ln = kv_lens.const_data_ptr<int64_t>();
  const int64_t* qn = q_lens.const_data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(qn[r] >= 1 && qn[r] <= ln[r], "q_lens[", r, "] = ", qn[r], " outside 1..kv_lens[", r, "] = ", ln[r]);
    total += qn[r];
  }
  TORCH_CHECK(total == t, "q_lens must sum to q's ", t, " rows, got ", total);
  TORCH_CHECK(extend_attention_supported(), "extend_attention needs a CPU with AVX-512 BF16 (this build has none)");
  Tensor out = at::empty({t, h * d}, q.options());
#ifdef SGRT_EXTEND_ATTENTION
  if (t == 0) return out;
  if (d == 64) {
    extend_attention_run<64>(q, k_cache, v_cache, slots, ln, qn, out);
  } else if (d == 128) {
    extend_attention_run<128>(q, k_cache, v_cache, slots, ln, qn, out);
  } else {
    extend_attention_run<256>(q, k_cache, v_cache, slots, ln, qn, out);
  }
#endif
  return out;
}

}  // namespace sgrt_layer
