// Weight-only quantized linear layers with group-wise scales on AVX-512 BF16 CPUs.
//
//   y[m, n] = sum_g ( scale[n, g] * sum_{k in g} code[n, k] * x[m, k]
//                   + offset[n, g] * sum_{k in g} x[m, k] )
//
// i.e. W[n, k] = scale[n, g] * code[n, k] + offset[n, g]: llama.cpp's Q4_1 block (d, m), and the
// same form with 8-bit codes. x and y are bfloat16, scale / offset float16 [N, K / group], code
// 0..15 (bits 4) or 0..255 (bits 8); fp32 sums, one round to nearest even at the end.
//
// Codes are widened to bfloat16 (exact: integers up to 256) and multiplied with vdpbf16ps
// (Intel's AVX512_BF16 "dot product of bf16 pairs": 16 fp32 lanes, each += a0*b0 + a1*b1),
// vectorized along N (lane j = output n0 + j, the pair = two consecutive k) with one x pair
// broadcast per instruction. 4-bit codes are widened without arithmetic: 0x4300 | q is the
// bfloat16 of 128 + q, so a group's sum is corrected by -128 * scale * sum(x) in the epilogue
// (folded into the offset). Each group's fp32 partial sum is scaled and offset with two fp32 FMAs.
//
// Packed layout (sgrt/kernels/woq.py builds it): blocks of 16 output rows, each block's K
// contiguous, as 32-word vectors: word w of the vector for k-pair p is code[n0 + w / 2, 2p + w % 2].
//   bits 8: one byte per word, vectors in k order (32 bytes a k-pair).
//   bits 4: 64-byte chunks of 4 vectors (k-pairs 4c .. 4c+3); byte 16L + 8s + i holds word
//           8L + i of vector s in its low nibble and of vector 2 + s in its high nibble (what
//           vpunpck{l,h}bw of the masked nibbles with 0x43 yields, 128-bit lane L).
// Every (m, n) is computed by the same sequence of instructions whatever M, the row tile or the
// thread split, so a row's result does not depend on the rest of the batch (bitwise).
#ifndef SGRT_WOQ_STANDALONE  // (a benchmark harness may define it to time the loops without torch)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <torch/library.h>
#endif

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t BLOCK_N = 16;   // output rows per packed block (one zmm of fp32 lanes)
constexpr int64_t MAX_TILE = 16;  // rows of x per register tile
constexpr int64_t SCALE_CHUNK = 4;  // blocks whose scales are transposed at a time (a multiple of every NB)

struct Ctx {
  int64_t M, N, K, G, group, kpg;  // kpg: k-pairs per group
  int64_t block_bytes, group_bytes;
  const uint8_t* w;
  const uint16_t* scales;   // f16 [N, G]
  const uint16_t* offsets;  // f16 [N, G]
  const uint32_t* xt;       // x pairs, tile t (rows 16t ..): [K / 2][rows of the tile]
  const float* xs;          // group sums of x, tile t: [G][rows of the tile]
  uint16_t* y;              // bf16 [M, N]
  int bits;
};

inline __m512 bcast_x(const uint32_t* p) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(*p)));
}

// acc += w . broadcast(*x) (vdpbf16ps with an embedded {1to16} broadcast of the x pair)
inline void dp_bcast(__m512& acc, __m512bh w, const uint32_t* x) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}

// 1 weight vector from 32 bytes of 8-bit codes: bf16 q (exact).
inline __m512bh unpack8(const uint8_t* p) {
  const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(b, a);  // words 0..15 from a, 16..31 from b
}

// Index vectors for transpose16x8 (vpermt2w picks 32 words out of two registers' 64).
struct TransposeIdx {
  __m512i r1a, r1b, r2a, r2b;
  TransposeIdx() {
    alignas(64) uint16_t a[32], b[32], c[32], d[32];
    for (int h = 0; h < 32; ++h) {
      const int row = h % 8, col = h / 8;  // round 1: rows 0..7 of 2 registers, 4 columns
      a[h] = static_cast<uint16_t>((row < 4 ? 0 : 32) + 8 * (row % 4) + col);
      b[h] = static_cast<uint16_t>(a[h] + 4);
      const int row2 = h % 16, col2 = h / 16;  // round 2: rows 0..15, 2 columns
      c[h] = static_cast<uint16_t>((row2 < 8 ? 0 : 32) + 8 * col2 + row2 % 8);
      d[h] = static_cast<uint16_t>(c[h] + 16);
    }
    r1a = _mm512_load_si512(a); r1b = _mm512_load_si512(b);
    r2a = _mm512_load_si512(c); r2b = _mm512_load_si512(d);
  }
};

// src: f16 [16 rows][ld] (columns g0 .. g0 + cnt - 1 used, cnt <= 8) -> dst: fp32 [cnt][16].
// Rows go in 4 registers of 4 x 8 words, two rounds of vpermt2w regroup them by column.
inline void transpose16x8(const uint16_t* src, int64_t ld, int cnt, float* dst, const TransposeIdx& t) {
  __m512i in[4];
  if (cnt == 8) {
    for (int q = 0; q < 4; ++q) {
      const uint16_t* r = src + 4 * q * ld;
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + ld)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * ld)), 2);
      in[q] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 3 * ld)), 3);
    }
  } else {
    const __mmask8 mk = static_cast<__mmask8>((1u << cnt) - 1);
    for (int q = 0; q < 4; ++q) {
      const uint16_t* r = src + 4 * q * ld;
      __m512i v = _mm512_castsi128_si512(_mm_maskz_loadu_epi16(mk, r));
      v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi16(mk, r + ld), 1);
      v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi16(mk, r + 2 * ld), 2);
      in[q] = _mm512_inserti32x4(v, _mm_maskz_loadu_epi16(mk, r + 3 * ld), 3);
    }
  }
  const __m512i a = _mm512_permutex2var_epi16(in[0], t.r1a, in[1]);  // cols 0..3, rows 0..7
  const __m512i b = _mm512_permutex2var_epi16(in[0], t.r1b, in[1]);  // cols 4..7, rows 0..7
  const __m512i c = _mm512_permutex2var_epi16(in[2], t.r1a, in[3]);  // cols 0..3, rows 8..15
  const __m512i d = _mm512_permutex2var_epi16(in[2], t.r1b, in[3]);  // cols 4..7, rows 8..15
  __m512i out[4];
  out[0] = _mm512_permutex2var_epi16(a, t.r2a, c);  // cols 0, 1
  out[1] = _mm512_permutex2var_epi16(a, t.r2b, c);  // cols 2, 3
  out[2] = _mm512_permutex2var_epi16(b, t.r2a, d);  // cols 4, 5
  out[3] = _mm512_permutex2var_epi16(b, t.r2b, d);  // cols 6, 7
  for (int q = 0; q < 4 && 2 * q < cnt; ++q) {
    _mm512_storeu_ps(dst + 32 * q, _mm512_cvtph_ps(_mm512_castsi512_si256(out[q])));
    if (2 * q + 1 < cnt) _mm512_storeu_ps(dst + 32 * q + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(out[q], 1)));
  }
}

// scale / offset of one block, transposed to [G][16] fp32; for 4-bit codes the offset
// absorbs the -128 * scale of the 0x4300 widening.
void block_scales(const Ctx& c, int64_t blk, float* s_out, float* o_out) {
  static const TransposeIdx t;
  const int64_t G = c.G;
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int cnt = static_cast<int>(std::min<int64_t>(8, G - g0));
    transpose16x8(c.scales + blk * BLOCK_N * G + g0, G, cnt, s_out + g0 * 16, t);
    transpose16x8(c.offsets + blk * BLOCK_N * G + g0, G, cnt, o_out + g0 * 16, t);
  }
  if (c.bits == 4) {
    const __m512 m128 = _mm512_set1_ps(-128.0f);
    for (int64_t g = 0; g < G; ++g)
      _mm512_storeu_ps(o_out + g * 16,
                       _mm512_fmadd_ps(m128, _mm512_loadu_ps(s_out + g * 16), _mm512_loadu_ps(o_out + g * 16)));
  }
}

// MT rows (m0 ..) x NB blocks (blk0 ..): y = the whole K reduction, written as bf16.
// Registers: MT * NB group accumulators, per block the masked nibbles (4-bit) and one widened
// vector at a time; the running sums live in `ot` ([MT][NB][16] fp32, L1) between groups.
template <int BITS, int MT, int NB>
void micro(const Ctx& c, int64_t blk0, int64_t m0, const float* sb, const float* ob, float* ot) {
  const uint32_t* xt = c.xt + m0 * (c.K / 2);
  const float* xs = c.xs + m0 * c.G;
  const int64_t G = c.G, kpg = c.kpg, sstride = G * 16;
  const __m512i m0f = _mm512_set1_epi8(0x0f);
  const __m512i c43 = _mm512_set1_epi8(0x43);
  const uint8_t* wp[NB];
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b) wp[b] = c.w + (blk0 + b) * c.block_bytes;
#pragma GCC unroll 64
  for (int i = 0; i < MT * NB; ++i) _mm512_storeu_ps(ot + 16 * i, _mm512_setzero_ps());

  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MT][NB];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    const uint32_t* xg = xt + g * kpg * MT;
    // The same group of the blocks the next call reads (the thread's range is one stream), into
    // L2 where few rows make the stream fast (measured: 15% faster at 1 row than into L1), into
    // L1 where many rows make it slow (3-5% faster at 8-16 rows).
    constexpr auto hint = MT <= 4 ? _MM_HINT_T1 : _MM_HINT_T0;
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
      for (int64_t off = 0; off < c.group_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wp[b] + NB * c.block_bytes + off), hint);
    // and the scales / offsets of the blocks SCALE_CHUNK ahead (32 bytes a group per block)
    if ((g & 1) == 0) {
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const int64_t at = (blk0 + b + SCALE_CHUNK) * BLOCK_N * G + g * 16;
        _mm_prefetch(reinterpret_cast<const char*>(c.scales + at), hint);
        _mm_prefetch(reinterpret_cast<const char*>(c.offsets + at), hint);
      }
    }
    for (int64_t p = 0; p < kpg; p += 4) {
      __m512i lo[NB], hi[NB];
      if constexpr (BITS == 4) {
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          const __m512i raw = _mm512_loadu_si512(wp[b] + p * 16);
          lo[b] = _mm512_and_si512(raw, m0f);
          hi[b] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m0f);
        }
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const uint32_t* xp = xg + (p + v) * MT;
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          __m512bh w;
          if constexpr (BITS == 4) {
            // vector v: low (v < 2) or high nibbles, bytes 0..7 (v even) or 8..15 of each lane
            const __m512i src = v < 2 ? lo[b] : hi[b];
            w = (__m512bh)(v % 2 == 0 ? _mm512_unpacklo_epi8(src, c43) : _mm512_unpackhi_epi8(src, c43));
          } else {
            w = unpack8(wp[b] + (p + v) * 32);
          }
#pragma GCC unroll 16
          for (int m = 0; m < MT; ++m) dp_bcast(acc[m][b], w, xp + m);
        }
      }
    }
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(sb + b * sstride + g * 16);
      const __m512 o = _mm512_loadu_ps(ob + b * sstride + g * 16);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        float* op = ot + 16 * (m * NB + b);
        __m512 r = _mm512_fmadd_ps(s, acc[m][b], _mm512_loadu_ps(op));
        _mm512_storeu_ps(op, _mm512_fmadd_ps(o, _mm512_set1_ps(xs[g * MT + m]), r));
      }
    }
    asm volatile("" ::: "memory");  // keep the running sums in ot (registers are for acc)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) wp[b] += c.group_bytes;
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(ot + 16 * (m * NB + b)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.y + (m0 + m) * c.N + (blk0 + b) * BLOCK_N), h);
    }
}

// Blocks per micro-kernel call for a tile of MT rows: enough independent accumulator chains to
// cover vdpbf16ps latency (6 cycles) and several code streams at small MT, within 32 zmm
// registers at large MT (measured: 4 blocks at 3-4 rows ~10% faster than 2).
constexpr int nb_for(int mt) { return mt <= 4 ? 4 : (mt <= 8 ? 2 : 1); }

template <int BITS, int MT>
void tile_blocks(const Ctx& c, int64_t b0, int64_t b1, int64_t m0, const float* sb, const float* ob, float* ot) {
  constexpr int NB = nb_for(MT);
  const int64_t sstride = c.G * 16;
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) micro<BITS, MT, NB>(c, b, m0, sb + (b - b0) * sstride, ob + (b - b0) * sstride, ot);
  for (; b < b1; ++b) micro<BITS, MT, 1>(c, b, m0, sb + (b - b0) * sstride, ob + (b - b0) * sstride, ot);
}

template <int BITS, int... MTs>
constexpr auto make_table(std::integer_sequence<int, MTs...>) {
  using Fn = void (*)(const Ctx&, int64_t, int64_t, int64_t, const float*, const float*, float*);
  return std::array<Fn, sizeof...(MTs)>{&tile_blocks<BITS, MTs + 1>...};
}

template <int BITS>
void run_blocks(const Ctx& c, int64_t b0, int64_t b1) {
  static constexpr auto table = make_table<BITS>(std::make_integer_sequence<int, MAX_TILE>{});
  // Scales of a few blocks at a time: small buffers (L1), and the x tile loop reuses each
  // block's codes from cache.
  constexpr int64_t CHUNK = SCALE_CHUNK;
  thread_local std::vector<float> buf;  // kept between calls: no allocation per call
  const size_t need = static_cast<size_t>(2 * CHUNK * c.G * 16 + MAX_TILE * 4 * 16);
  if (buf.size() < need) buf.resize(need);
  float* sb = buf.data();
  float* ob = sb + CHUNK * c.G * 16;
  float* ot = ob + CHUNK * c.G * 16;
  for (int64_t cb = b0; cb < b1; cb += CHUNK) {
    const int64_t ce = std::min(b1, cb + CHUNK);
    for (int64_t b = cb; b < ce; ++b) block_scales(c, b, sb + (b - cb) * c.G * 16, ob + (b - cb) * c.G * 16);
    for (int64_t m0 = 0; m0 < c.M; m0 += MAX_TILE) {
      const int64_t mt = std::min<int64_t>(MAX_TILE, c.M - m0);
      table[mt - 1](c, cb, ce, m0, sb, ob, ot);
    }
  }
}

// In-register transpose of a 16 x 16 matrix of 32-bit elements (r[i] = row i -> r[j] = column j).
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane L: rows 4i .. 4i+3 of column 4L + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xdd);
  }
}

// Rows x[0 .. mt) ([mt][K] bf16, mt <= 16) -> the tile's pairs t: [K/2][mt] (32-bit: 2 bf16) and
// fp32 group sums s: [G][mt]. A row's sum is a chain of vdpbf16ps against (1, 1) in its own lane
// (pairs in k order), the same instructions for every mt, so it does not depend on the tile.
void prepare_tile(const uint16_t* x, int64_t K, int64_t group, int mt, uint32_t* t, float* s) {
  const int64_t G = K / group, ppg = group / 2;
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  if (mt == 1) {
    std::memcpy(t, x, static_cast<size_t>(K) * 2);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t p = g * ppg; p < (g + 1) * ppg; ++p) acc = _mm512_dpbf16_ps(acc, (__m512bh)bcast_x(t + p), ones);
      s[g] = _mm512_cvtss_f32(acc);
    }
    return;
  }
  const __mmask16 mk = static_cast<__mmask16>((1u << mt) - 1);
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p0 = g * ppg; p0 < (g + 1) * ppg; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = i < mt ? _mm512_loadu_si512(x + i * K + 2 * p0) : _mm512_setzero_si512();
      transpose16x16(r);  // r[j], lane i: row i's pair p0 + j
      for (int j = 0; j < 16; ++j) {
        acc = _mm512_dpbf16_ps(acc, (__m512bh)r[j], ones);
        _mm512_mask_storeu_epi32(t + (p0 + j) * mt, mk, r[j]);
      }
    }
    _mm512_mask_storeu_ps(s + g * mt, mk, acc);
  }
}

// x [M][K] -> tiles of 16 rows (the last one shorter): pairs at xt + 16t * K/2, sums at xs + 16t * G.
void prepare_x(const uint16_t* x, int64_t M, int64_t K, int64_t group, uint32_t* xt, float* xs) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_TILE) {
    const int mt = static_cast<int>(std::min<int64_t>(MAX_TILE, M - m0));
    prepare_tile(x + m0 * K, K, group, mt, xt + m0 * (K / 2), xs + m0 * (K / group));
  }
}

#ifndef SGRT_WOQ_STANDALONE
at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t n, int64_t k, int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "sgrt_woq.linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "sgrt_woq.linear: group must be 32, 64 or 128, got ", group);
  TORCH_CHECK(n > 0 && n % BLOCK_N == 0,
              "sgrt_woq.linear: n (output features) must be a positive multiple of 16, got ", n);
  TORCH_CHECK(k > 0 && k % group == 0,
              "sgrt_woq.linear: k (input features) must be a positive multiple of group=", group, ", got ", k);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu() && offsets.device().is_cpu(),
              "sgrt_woq.linear: all tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "sgrt_woq.linear: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "sgrt_woq.linear: x must be [M, k=", k, "], got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "sgrt_woq.linear: x must be contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "sgrt_woq.linear: packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == n * k * bits / 8,
              "sgrt_woq.linear: packed must be contiguous with n*k*bits/8=", n * k * bits / 8, " bytes, got ",
              packed.numel());
  const int64_t G = k / group;
  for (const auto* t : {&scales, &offsets}) {
    const char* name = t == &scales ? "scales" : "offsets";
    TORCH_CHECK(t->scalar_type() == at::kHalf, "sgrt_woq.linear: ", name, " must be float16, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == G, "sgrt_woq.linear: ", name, " must be [n=", n,
                ", k/group=", G, "], got ", t->sizes());
    TORCH_CHECK(t->is_contiguous(), "sgrt_woq.linear: ", name, " must be contiguous");
  }
  const int64_t M = x.size(0);
  at::Tensor y(at::detail::empty_cpu({M, n}, at::kBFloat16));
  if (M == 0) return y;

  // x in tile order: kept between calls (no allocation per call) up to 64 rows, beyond that
  // (prefill) allocated per call so that a thread does not hold a large buffer.
  thread_local std::vector<uint32_t> xt_keep;
  thread_local std::vector<float> xs_keep;
  std::vector<uint32_t> xt_once;
  std::vector<float> xs_once;
  const bool keep = M <= 64;
  std::vector<uint32_t>& xt = keep ? xt_keep : xt_once;
  std::vector<float>& xs = keep ? xs_keep : xs_once;
  if (xt.size() < static_cast<size_t>(M * (k / 2))) xt.resize(static_cast<size_t>(M * (k / 2)));
  if (xs.size() < static_cast<size_t>(M * G)) xs.resize(static_cast<size_t>(M * G));
  prepare_x(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, k, group, xt.data(), xs.data());

  Ctx c;
  c.M = M; c.N = n; c.K = k; c.G = G; c.group = group; c.kpg = group / 2;
  c.block_bytes = BLOCK_N * k * bits / 8;
  c.group_bytes = BLOCK_N * group * bits / 8;
  c.w = packed.data_ptr<uint8_t>();
  c.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  c.offsets = reinterpret_cast<const uint16_t*>(offsets.data_ptr());
  c.xt = xt.data();
  c.xs = xs.data();
  c.y = reinterpret_cast<uint16_t*>(y.data_ptr());
  c.bits = static_cast<int>(bits);

  const int64_t nblocks = n / BLOCK_N;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    if (bits == 4) run_blocks<4>(c, b0, b1);
    else run_blocks<8>(c, b0, b1);
  });
  return y;
}

#endif
}  // namespace

#ifndef SGRT_WOQ_STANDALONE
TORCH_LIBRARY(sgrt_woq, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, int group) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(woq_linear));
}
#endif
