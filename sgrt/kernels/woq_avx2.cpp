// Weight-only quantized linear layers with group-wise scales on AVX2 + FMA CPUs (no AVX-512):
// the same operator, packed layout and arithmetic form as woq_cpu.cpp, for decode-sized inputs.
//
//   y[m, n] = sum_g ( scale[n, g] * sum_{k in g} code[n, k] * x[m, k]
//                   + offset[n, g] * sum_{k in g} x[m, k] )
//
// x and y bfloat16, scale / offset float16 [N, K / group], codes 0..15 (bits 4) or 0..255
// (bits 8) in woq.py's packed layout (blocks of 16 output rows; per k-pair p a 32-word vector,
// word w = code[n0 + w / 2, 2p + w % 2]; 4-bit: 64-byte chunks of 4 vectors, byte 16L + 8s + i
// holds word 8L + i of vector s in its low nibble and of vector 2 + s in its high nibble).
//
// Here the products are fp32 FMAs (x widened from bf16 exactly, codes converted exactly): 8 bytes
// of one 128-bit lane L of the layout are the 8 (row, k parity) words of rows 4L .. 4L+3, so one
// vpmovzxbd gives 8 fp32 lanes (row 4L + j / 2, parity j % 2) for two k-pairs (low and high
// nibble), multiplied by the x pair broadcast as (x[2p], x[2p+1]) x 4. Per group: the parities
// are added (vhaddps), then y += scale * partial + offset * sum(x over the group), fp32; one
// round to nearest even at the end. Every row is computed by the same instructions in the same
// order whatever M or the thread split (the row loop is innermost, per block), so a row's result
// does not depend on the rest of the batch (bitwise).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK_N = 16;

// 8 rows x 8 groups of float16 (rows r[i], 8 values each) -> 8 columns of 8 rows, as fp32.
inline void transpose8x8_f16(const __m128i* r, __m256* out) {
  const __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
  const __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
  const __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
  const __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
  const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  out[0] = _mm256_cvtph_ps(_mm_unpacklo_epi64(b0, b4));
  out[1] = _mm256_cvtph_ps(_mm_unpackhi_epi64(b0, b4));
  out[2] = _mm256_cvtph_ps(_mm_unpacklo_epi64(b1, b5));
  out[3] = _mm256_cvtph_ps(_mm_unpackhi_epi64(b1, b5));
  out[4] = _mm256_cvtph_ps(_mm_unpacklo_epi64(b2, b6));
  out[5] = _mm256_cvtph_ps(_mm_unpackhi_epi64(b2, b6));
  out[6] = _mm256_cvtph_ps(_mm_unpacklo_epi64(b3, b7));
  out[7] = _mm256_cvtph_ps(_mm_unpackhi_epi64(b3, b7));
}

// A block's [16, G] float16 table (row stride G) -> [G][16] fp32.
void block_table(const uint16_t* src, int64_t G, float* dst) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int cnt = static_cast<int>(std::min<int64_t>(8, G - g0));
    for (int half = 0; half < 2; ++half) {
      __m128i r[8];
      for (int i = 0; i < 8; ++i) {
        const uint16_t* row = src + (half * 8 + i) * G + g0;
        if (cnt == 8) {
          r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        } else {  // the tail: never read past the row (the last row ends the tensor)
          alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          std::memcpy(tmp, row, static_cast<size_t>(cnt) * 2);
          r[i] = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
        }
      }
      __m256 cols[8];
      transpose8x8_f16(r, cols);
      for (int j = 0; j < cnt; ++j) _mm256_storeu_ps(dst + (g0 + j) * 16 + half * 8, cols[j]);
    }
  }
}

inline __m256 bcast_pair(const float* p) {  // (p[0], p[1]) x 4
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
}

inline __m256 widen8(const uint8_t* p) {  // 8 bytes -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// lanes (row 4L + j / 2, parity j % 2) of quads L = 0, 1 -> rows 0 .. 7 (parities added)
inline __m256 fold(__m256 q0, __m256 q1) {
  const __m256 h = _mm256_hadd_ps(q0, q1);  // rows 0 1 4 5 2 3 6 7
  return _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

// fp32 -> bf16, round to nearest even (NaN stays NaN: its quiet bit survives the add)
inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: 4 words, twice
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// One row, one block: the group partials (4 quads x 2 accumulators), then the running sums.
template <int BITS>
inline void row_block(const uint8_t* w, const float* x, const float* xs, const float* sb, const float* ob,
                      int64_t G, int64_t group, int64_t group_bytes, uint16_t* y) {
  __m256 r0 = _mm256_setzero_ps(), r1 = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[4][2];
    for (int L = 0; L < 4; ++L) acc[L][0] = acc[L][1] = _mm256_setzero_ps();
    const float* xg = x + g * group;
    const uint8_t* wg = w + g * group_bytes;
    if constexpr (BITS == 4) {
      for (int64_t c = 0; c < group / 8; ++c) {  // 64-byte chunk: k-pairs 4c' .. 4c'+3
        const uint8_t* p = wg + c * 64;
        const __m256 x0 = bcast_pair(xg + 8 * c), x1 = bcast_pair(xg + 8 * c + 2);
        const __m256 x2 = bcast_pair(xg + 8 * c + 4), x3 = bcast_pair(xg + 8 * c + 6);
        const __m256i m0f = _mm256_set1_epi32(0x0f);
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
          const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16 * L)));
          const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16 * L + 8)));
          acc[L][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, m0f)), x0, acc[L][0]);
          acc[L][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, m0f)), x1, acc[L][1]);
          acc[L][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), x2, acc[L][0]);
          acc[L][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), x3, acc[L][1]);
        }
      }
    } else {
      for (int64_t p = 0; p < group / 2; ++p) {  // 32 bytes a k-pair
        const __m256 xp = bcast_pair(xg + 2 * p);
        const uint8_t* q = wg + p * 32;
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) acc[L][p & 1] = _mm256_fmadd_ps(widen8(q + 8 * L), xp, acc[L][p & 1]);
      }
    }
    const __m256 lo = fold(_mm256_add_ps(acc[0][0], acc[0][1]), _mm256_add_ps(acc[1][0], acc[1][1]));
    const __m256 hi = fold(_mm256_add_ps(acc[2][0], acc[2][1]), _mm256_add_ps(acc[3][0], acc[3][1]));
    const __m256 sx = _mm256_set1_ps(xs[g]);
    r0 = _mm256_fmadd_ps(_mm256_loadu_ps(ob + g * 16), sx, _mm256_fmadd_ps(_mm256_loadu_ps(sb + g * 16), lo, r0));
    r1 = _mm256_fmadd_ps(_mm256_loadu_ps(ob + g * 16 + 8), sx, _mm256_fmadd_ps(_mm256_loadu_ps(sb + g * 16 + 8), hi, r1));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), to_bf16(r0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 8), to_bf16(r1));
}

at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t n, int64_t k, int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "sgrt_woq_avx2.linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group == 32 || group == 64 || group == 128,
              "sgrt_woq_avx2.linear: group must be 32, 64 or 128, got ", group);
  TORCH_CHECK(n > 0 && n % BLOCK_N == 0,
              "sgrt_woq_avx2.linear: n (output features) must be a positive multiple of 16, got ", n);
  TORCH_CHECK(k > 0 && k % group == 0,
              "sgrt_woq_avx2.linear: k (input features) must be a positive multiple of group=", group, ", got ", k);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu() && offsets.device().is_cpu(),
              "sgrt_woq_avx2.linear: all tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "sgrt_woq_avx2.linear: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "sgrt_woq_avx2.linear: x must be [M, k=", k, "], got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "sgrt_woq_avx2.linear: x must be contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "sgrt_woq_avx2.linear: packed must be uint8, got ",
              packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == n * k * bits / 8,
              "sgrt_woq_avx2.linear: packed must be contiguous with n*k*bits/8=", n * k * bits / 8, " bytes, got ",
              packed.numel());
  const int64_t G = k / group;
  for (const auto* t : {&scales, &offsets}) {
    const char* name = t == &scales ? "scales" : "offsets";
    TORCH_CHECK(t->scalar_type() == at::kHalf, "sgrt_woq_avx2.linear: ", name, " must be float16, got ",
                t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == G, "sgrt_woq_avx2.linear: ", name,
                " must be [n=", n, ", k/group=", G, "], got ", t->sizes());
    TORCH_CHECK(t->is_contiguous(), "sgrt_woq_avx2.linear: ", name, " must be contiguous");
  }
  const int64_t M = x.size(0);
  at::Tensor y(at::detail::empty_cpu({M, n}, at::kBFloat16));
  if (M == 0) return y;

  // x widened to fp32 and its group sums (a fixed order per row: 8 lanes, then the lanes)
  std::vector<float> xf(static_cast<size_t>(M * k));
  std::vector<float> xs(static_cast<size_t>(M * G));
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t i = 0; i < M * k; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + i)));
    _mm256_storeu_ps(xf.data() + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (int64_t r = 0; r < M * G; ++r) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t j = 0; j < group; j += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xf.data() + r * group + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, s);
    xs[r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }

  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* op = reinterpret_cast<const uint16_t*>(offsets.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t block_bytes = BLOCK_N * k * bits / 8, group_bytes = BLOCK_N * group * bits / 8;
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> tables(static_cast<size_t>(2 * G * 16));
    float* sb = tables.data();
    float* ob = sb + G * 16;
    for (int64_t b = b0; b < b1; ++b) {
      block_table(sp + b * BLOCK_N * G, G, sb);
      block_table(op + b * BLOCK_N * G, G, ob);
      const uint8_t* w = wp + b * block_bytes;
      for (int64_t m = 0; m < M; ++m) {
        if (bits == 4)
          row_block<4>(w, xf.data() + m * k, xs.data() + m * G, sb, ob, G, group, group_bytes, yp + m * n + b * BLOCK_N);
        else
          row_block<8>(w, xf.data() + m * k, xs.data() + m * G, sb, ob, G, group, group_bytes, yp + m * n + b * BLOCK_N);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(sgrt_woq_avx2, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, int group) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(woq_linear));
}
