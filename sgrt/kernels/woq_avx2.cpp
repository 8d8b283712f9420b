// Weight-only quantized linear layers with group-wise scales on AVX2 + FMA CPUs (no AVX-512):
// the same operator signature and code layout as woq_cpu.cpp, with the scales fused into the
// weight stream, and exact integer dot products on quantized activations.
//
// x is quantized per row and per block b of 32 inputs, symmetric, in fp32: a = max |x|,
// t = x * (127 / a), q1 = round(t) (int8: llama.cpp's Q8 activation blocks), q2 = round((t - q1)
// * 254) (the remainder, int8; t - q1 is exact), Q = 254 q1 + q2, dx[b] = a / 32258, so x ~ dx * Q
// with a step of max|x| / 32258 (rounding half to even throughout; q1 alone, an int8 x, more
// than doubled the int4 model's KL against bfloat16). Q = 0, dx = 0 where a < 2^-100; dx = NaN
// where the block holds a NaN or an infinity. With g the scale group of block b, per output row n:
//
//   isum = sum_{k in b} code[n, k] * Q[k]   (exact, integer)     qsum = sum_{k in b} Q[k]
//   y[m, n] = sum_b dx[b] * (scale[n, g] * isum + offset[n, g] * qsum)
//
// i.e. W @ (dx * Q), in fp32 with one rounding per operation, in this order per block:
// t = scale * float(isum); u = offset * float(qsum); t = t + u; y = y + dx * t (no FMA: built with
// -ffp-contract=off, so that tests reproduce it bit for bit), blocks in k order, then one round to
// nearest even to bfloat16. float(isum) is exact for 4-bit codes (|isum| < 2^24).
//
// Weight stream (woq.py's fuse, done once at load): per block of 16 output rows, per scale group
// in k order, a 64-byte header (the 16 rows' float16 scales, then their 16 offsets) followed by
// the group's codes in pack()'s layout (below), so that a thread reads one sequential run (one
// prefetch stream, no scale arrays on the side) and widens a group's scales with 4 vcvtph2ps.
// Compact header (8-bit codes whose every offset is -c * scale, e.g. a GGUF's Q8_0 / Q5_0 blocks;
// the `bits` argument 8 + 256 c, see Header): the 16 scales alone (32 bytes), offset = scale * (-c)
// rebuilt in fp32, bitwise the stored offset's value (woq.py checks that before it picks the form).
// Codes (woq.py's pack): blocks of 16 output rows; per k-pair p a 32-word vector, word w =
// code[n0 + w / 2, 2p + w % 2]. 4-bit: 64-byte chunks of 4 vectors (k-pairs 4c .. 4c+3), byte
// 16L + 8s + i holds word 8L + i of vector s (low nibble) and of vector 2 + s (high nibble). So
// the 32 bytes A = chunk[0:32] hold, in their low nibbles, k-pair 0 rows 0-3 (bytes 0-7, each row
// a (parity 0, parity 1) byte pair), k-pair 1 rows 0-3 (8-15), k-pair 0 rows 4-7 (16-23), k-pair 1
// rows 4-7 (24-31); in their high nibbles k-pairs 2 and 3 likewise; B = chunk[32:64] rows 8-15.
// vpmaddubsw(low nibbles of A, X01) with X01 = the s8 pairs (q[2p], q[2p+1]) of k-pairs 0 / 1 in
// the matching 8-byte segments gives 16 s16 lanes (row, k-pair): per 128-bit lane rows r0..r0+3
// of k-pair 0, then of k-pair 1. Per block of 32 inputs (4 chunks) a lane adds 8 pair sums of at
// most 2 * 15 * 127, 30480 < 2^15: exact. Then one vpshufb puts each row's two lanes side by side
// and vpmaddwd with ones gives the s32 row sums, rows 0-7 (from A) and 8-15 (from B) in order.
// This is done for q1 and for q2 (sums s1, s2), and isum = 254 s1 + s2 (vpmaddwd with 254s).
// 8-bit: 32 bytes a k-pair; vpmovzxbw of bytes 0-15 gives rows 0-7 as (parity 0, parity 1) word
// pairs, vpmaddwd with the s16 pair (Q[2p], Q[2p+1]) the s32 row sums in order (rows 8-15 from
// bytes 16-31), exact (|Q| <= 32385: 16 pairs of 2 * 255 * 32385 stay below 2^31).
//
// The X vectors depend only on x: x is quantized once per call, expanded per tile of rows, and
// reused by every 16-row weight block. Rows of x are processed in tiles, four at a time per weight
// load where there are four (8-bit codes: block8x4; 4-bit codes with int16 activations:
// block4x4w, the nibbles widened to words against the int16 Q, the same integer isum), then two,
// then one (4-bit: expand4's X); a row's integer sums are exact whatever the grouping and its fp32
// operations are the same instructions in the same order, so a row's result does not depend on
// the other rows of the batch or on the thread split (bitwise). On AVX-512 VNNI CPUs the multi-row
// tiles run as 512-bit kernels instead (block_512i, block4w_512, block8_512: 16, 8, 4 rows; "AVX-512 VNNI
// prefill tiles" below), with the same integer sums and float operations: the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "sgrt/bf16.h"
#include "sgrt/raw_calls.h"

namespace {

constexpr int64_t BLOCK_N = 16;
// Software prefetch distance in bytes of the weight stream: decode streams every weight once from
// DRAM, and the hardware prefetcher alone left the kernel at ~1/3 of the read bandwidth on the
// 2-core EPYC; 2 KB ahead measured 0.85-0.90x the time (layers) and 0.75-0.88x (the int8 LM head);
// with the fused stream, 4 KB ahead 0.94-0.96x of 2 KB (decode's 120 layers, 1 and 2 threads;
// 8 KB no better). (The macros let bench experiments build variants.)
#ifndef SGRT_PREFETCH_BYTES
#define SGRT_PREFETCH_BYTES 4096
#endif
#ifndef SGRT_PREFETCH_HINT
#define SGRT_PREFETCH_HINT _MM_HINT_T0
#endif
constexpr int64_t PREFETCH_BYTES = SGRT_PREFETCH_BYTES;
// One row of x against 8-bit codes (decode; the int8 LM head is 65% of Gemma 3's bytes a token):
// each thread reads its range of 16-row blocks as this many contiguous parts side by side
// (block8_streams), no software prefetch. One prefetched stream read at 0.85-0.92x torch.sum's rate
// over the same bytes on the 2-core EPYC; 4 streams 1.10-1.25x (1.28-1.57x the speed, 1 thread,
// bench/woq_kernel.py --ab REV --bits 8 --rows 1); 3 and 6 no better than 4, and prefetching each
// stream 4 KB ahead lost most of the gain. (1: the single stream.)
#ifndef SGRT_WOQ8_STREAMS
#define SGRT_WOQ8_STREAMS 4
#endif
constexpr int STREAMS8 = SGRT_WOQ8_STREAMS;

// One row of x against 4-bit codes (decode's int4 projections): each thread reads its range of
// 16-row blocks as this many contiguous parts side by side (block4_streams), prefetching each
// part's stream SGRT_WOQ4_STREAM_PREFETCH bytes ahead (0: not at all). (1: the single prefetched
// stream, block4.) The 4-bit kernel does twice the int8 one's work a byte (two vpmaddubsw per
// code against q1 and q2), so one prefetched stream already read at 0.6-0.85x torch.sum's rate
// from DRAM (1 thread): 3 streams without prefetch 0.95-1.16x its speed there, median ~1.05 on a
// loaded machine (bench/woq_kernel.py --ab REV --rows 1 --copies 120), a decode step 0.99-1.07x
// the speed (bench/native_step.py --base REV --threads 1); 2 and 4 streams, or a prefetch per
// stream, no better than 3 within the noise (--ab HEAD --base-define SGRT_WOQ4_STREAMS=4).
#ifndef SGRT_WOQ4_STREAMS
#define SGRT_WOQ4_STREAMS 3
#endif
#ifndef SGRT_WOQ4_STREAM_PREFETCH
#define SGRT_WOQ4_STREAM_PREFETCH 0
#endif
constexpr int STREAMS4 = SGRT_WOQ4_STREAMS;
constexpr int64_t STREAM4_PREFETCH = SGRT_WOQ4_STREAM_PREFETCH;

// Bytes of int16 activations a tile of rows holds for 8-bit codes (see linear_raw).
#ifndef SGRT_TILE8
#define SGRT_TILE8 131072
#endif
// Bytes of expanded activations a tile of rows holds for 4-bit codes (see linear_blocks).
#ifndef SGRT_TILE4
#define SGRT_TILE4 262144
#endif
#ifndef SGRT_BLOCK4W
#define SGRT_BLOCK4W 1
#endif
constexpr int64_t QBLOCK = 32;  // inputs per activation quantization block
constexpr int64_t HEADER_BYTES = 64;  // a group's 16 float16 scales, then its 16 float16 offsets

// The operators' `bits` argument: the code width (4 or 8) plus 256 * c. c = 0: each group header
// holds the 16 scales and the 16 offsets (HEADER_BYTES). c in 1..255 (8-bit codes): the compact
// header, the 16 scales alone (32 bytes), for a tensor whose every offset is exactly -c * scale
// (woq.py's symmetric_constant checks it in float32, bit for bit): the kernel rebuilds offset =
// scale * (-c) in float32, the same value the stored float16 offset widens to, so the epilogue
// computes the same bits. (Llama.cpp's Q8_0 read as codes q + 128: c = 128; Q5_0 as codes q: 16.)
//
// K-quant stream (the `bits` argument 4 + KQ_FLAG: a GGUF's Q4_K blocks as they are, woq.py's
// fuse_kq4): per block of 16 output rows, per super-block of 256 inputs in k order, a
// KQ_HEADER_BYTES header (the 16 rows' float16 d, their 16 float16 dmin, then the 6-bit scales
// sc[j][row] and mins mn[j][row] as bytes, sub-group j = 0..7 of 32 inputs major) followed by the
// super-block's 8 groups of 4-bit codes, each exactly as a 32-input group of the Q4_1-form stream.
// The kernel rebuilds each group's scale = d * sc[j] and offset = dmin * (-mn[j]) in fp32 (exact:
// a float16 times an integer below 64), so that scale * code + offset is the file's weight with
// the one rounding of gguf's dequantize; 4.625 bits a weight against the Q4_1 form's 5.
struct Header {
  int64_t bytes;  // a group header's bytes in the stream (K-quant: a super-block's)
  float negc;     // -c (compact header), or 0 (offsets stored)
  bool kq;        // a K-quant super-block header (8 groups of 32 inputs)
};
constexpr int64_t KQ_FLAG = int64_t(1) << 16;
constexpr int64_t KQ_HEADER_BYTES = 320;  // 16 d, 16 dmin (float16), 8 x 16 sc, 8 x 16 mn (bytes)
constexpr int KQ_GROUP_SHIFT = 3;         // log2(8 groups of 32 inputs a super-block)
inline int64_t width_of(int64_t bits) { return bits & 255; }
inline Header header_of(int64_t bits) {
  if (bits & KQ_FLAG) return {KQ_HEADER_BYTES, 0.0f, true};
  const int64_t c = (bits >> 8) & 255;
  return {c ? HEADER_BYTES / 2 : HEADER_BYTES, c ? -static_cast<float>(c) : 0.0f, false};
}
// A stream's bytes per 16-row block (k inputs, groups of `group`; the 8-bit part after a 5-bit one
// not included).
inline int64_t block_bytes_of(const Header& hd, int64_t width, int64_t k, int64_t group) {
  if (hd.kq) return k / 256 * (KQ_HEADER_BYTES + BLOCK_N * 256 * width / 8);
  return k / group * (hd.bytes + BLOCK_N * group * width / 8);
}
// log2 of a header's blocks of 32 inputs
inline int group_shift_of(const Header& hd, int64_t group) {
  return hd.kq ? KQ_GROUP_SHIFT : group == 32 ? 0 : group == 64 ? 1 : 2;
}

// 8 fp32 outputs -> bf16, round to nearest even (sgrt/bf16.h: no NaN test, see there)
using sgrt::bf16::from_float8;

// One row of x (bf16, k values) -> per block of 32: dx and qsum (as float), and the integer
// activations Q = 254 q1 + q2 as q1, q2 (int8, for the 4-bit kernel) or Q (int16, 8-bit kernel);
// either pointer may be null. act8 (the opt-in int8 activations, linear_q8): Q = q1 alone,
// dx = a / 127, qsum = sum q1 (q2 is not written).
void quantize_row(const uint16_t* x, int64_t k, int8_t* q1, int8_t* q2, int16_t* Q, float* dx, float* qs,
                  bool act8 = false) {
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  const __m256 f254 = _mm256_set1_ps(254.0f);
  for (int64_t b = 0; b < k / QBLOCK; ++b) {
    __m256 v[4];
    __m256i amax = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + b * QBLOCK + 8 * j)));
      const __m256i bits = _mm256_slli_epi32(w, 16);
      v[j] = _mm256_castsi256_ps(bits);
      // |x| as integers orders like the values, NaN above infinity: the max keeps a NaN
      amax = _mm256_max_epi32(amax, _mm256_and_si256(bits, absmask));
    }
    amax = _mm256_max_epi32(amax, _mm256_permute2x128_si256(amax, amax, 1));
    amax = _mm256_max_epi32(amax, _mm256_shuffle_epi32(amax, 0x4e));
    amax = _mm256_max_epi32(amax, _mm256_shuffle_epi32(amax, 0xb1));
    const uint32_t abits = static_cast<uint32_t>(_mm256_cvtsi256_si32(amax));
    float a;
    std::memcpy(&a, &abits, 4);
    const int64_t o = b * QBLOCK;
    if (abits >= 0x7f800000u || a < 0x1p-100f) {  // NaN / infinity, or (next to) zero
      if (q1) std::memset(q1 + o, 0, QBLOCK);
      if (q2 && !act8) std::memset(q2 + o, 0, QBLOCK);
      if (Q) std::memset(Q + o, 0, QBLOCK * 2);
      dx[b] = abits >= 0x7f800000u ? __builtin_nanf("") : 0.0f;
      qs[b] = 0.0f;
      continue;
    }
    const __m256 id = _mm256_set1_ps(127.0f / a);
    constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i1[4], i2[4], iq[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 t = _mm256_mul_ps(v[j], id);  // in -127 .. 127
      const __m256 r1 = _mm256_round_ps(t, RN);
      // t - r1 is exact (|.| <= 1/2), so q2 in -127 .. 127
      const __m256 r2 = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, r1), f254), RN);
      i1[j] = _mm256_cvtps_epi32(r1);
      i2[j] = _mm256_cvtps_epi32(r2);
      iq[j] = act8 ? i1[j] : _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(i1[j], 8), _mm256_slli_epi32(i1[j], 1)), i2[j]);
    }
    // (packs works per 128-bit lane: the permutations put the values back in order)
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    if (q1) {
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i1[0], i1[1]), _mm256_packs_epi32(i1[2], i1[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q1 + o), _mm256_permutevar8x32_epi32(p, order));
    }
    if (q2 && !act8) {
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i2[0], i2[1]), _mm256_packs_epi32(i2[2], i2[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q2 + o), _mm256_permutevar8x32_epi32(p, order));
    }
    if (Q) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Q + o), _mm256_permute4x64_epi64(_mm256_packs_epi32(iq[0], iq[1]), 0xd8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Q + o + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(iq[2], iq[3]), 0xd8));
    }
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(iq[0], iq[1]), _mm256_add_epi32(iq[2], iq[3]));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
    int32_t t = 0;
    for (int i = 0; i < 8; ++i) t += lanes[i];
    dx[b] = act8 ? a / 127.0f : a / 32258.0f;  // (127 * 254: the step of Q)
    qs[b] = static_cast<float>(t);
  }
}

// q1, q2 (k int8 each) -> the 4-bit kernel's X vectors: per chunk c (8 inputs) 128 bytes, X01 and
// X23 of q1, then of q2; X01's 8-byte segments 0 and 2 hold (q[8c], q[8c+1]) x 4, segments 1 and 3
// (q[8c+2], q[8c+3]) x 4; X23 likewise with inputs 8c+4 .. 8c+7. q2 null (int8 activations): 64
// bytes a chunk, q1's two vectors.
void expand4(const int8_t* q1, const int8_t* q2, int64_t k, int8_t* X) {
  if (!q2) {
    const __m256i c01 = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                         0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3);
    const __m256i c23 = _mm256_add_epi8(c01, _mm256_set1_epi8(4));
    for (int64_t c = 0; c < k / 8; ++c) {
      int64_t v1;
      std::memcpy(&v1, q1 + 8 * c, 8);
      const __m256i b1 = _mm256_set1_epi64x(v1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 64 * c), _mm256_shuffle_epi8(b1, c01));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 64 * c + 32), _mm256_shuffle_epi8(b1, c23));
    }
    return;
  }
  const __m256i ctl01 = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                         0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3);
  const __m256i ctl23 = _mm256_add_epi8(ctl01, _mm256_set1_epi8(4));
  for (int64_t c = 0; c < k / 8; ++c) {
    int64_t v1, v2;
    std::memcpy(&v1, q1 + 8 * c, 8);
    std::memcpy(&v2, q2 + 8 * c, 8);
    const __m256i b1 = _mm256_set1_epi64x(v1), b2 = _mm256_set1_epi64x(v2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 128 * c), _mm256_shuffle_epi8(b1, ctl01));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 128 * c + 32), _mm256_shuffle_epi8(b1, ctl23));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 128 * c + 64), _mm256_shuffle_epi8(b2, ctl01));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 128 * c + 96), _mm256_shuffle_epi8(b2, ctl23));
  }
}

struct RowArgs {
  const void* X;     // the row's activations: expand4's vectors (4-bit), the int16 q (8-bit)
  const float* dx;   // [k / 32]
  const float* qs;   // [k / 32]
  uint16_t* y;       // the row's 16 outputs of this block
};

// y (rows 0-7, 8-15) += dx * (scale * isum + offset * qsum), in that order of operations; so = the
// group's scales (rows 0-7, 8-15) and offsets (the same), widened from float16 (exact)
inline void epilogue(__m256i s0, __m256i s1, const __m256* so, float dx, float qs, __m256& y0, __m256& y1) {
  const __m256 vd = _mm256_set1_ps(dx), vq = _mm256_set1_ps(qs);
  __m256 t0 = _mm256_mul_ps(so[0], _mm256_cvtepi32_ps(s0));
  __m256 t1 = _mm256_mul_ps(so[1], _mm256_cvtepi32_ps(s1));
  t0 = _mm256_add_ps(t0, _mm256_mul_ps(so[2], vq));
  t1 = _mm256_add_ps(t1, _mm256_mul_ps(so[3], vq));
  y0 = _mm256_add_ps(y0, _mm256_mul_ps(vd, t0));
  y1 = _mm256_add_ps(y1, _mm256_mul_ps(vd, t1));
}

// A group header's 16 float16 scales and 16 offsets -> 4 fp32 vectors
inline void load_header(const uint8_t* h, __m256* so) {
  for (int i = 0; i < 4; ++i) so[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16 * i)));
}

// The same for a header of format hd: stored offsets, or (compact) offset = scale * (-c), exact in
// float32 where the stream was built (see Header)
inline void load_header(const uint8_t* h, __m256* so, const Header& hd) {
  if (hd.negc == 0.0f) return load_header(h, so);
  so[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  so[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16)));
  const __m256 negc = _mm256_set1_ps(hd.negc);
  so[2] = _mm256_mul_ps(so[0], negc);
  so[3] = _mm256_mul_ps(so[1], negc);
}

// Sub-group j (0..7) of a K-quant super-block header h -> the 16 rows' scales d * sc[j] and
// offsets dmin * (-mn[j]) as 4 fp32 vectors (load_header's order), each product exact
inline void load_kheader(const uint8_t* h, int64_t j, __m256* so) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 64 + 16 * j));
  const __m128i mn = _mm_sub_epi8(_mm_setzero_si128(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 192 + 16 * j)));
  const auto f = [](__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); };  // (sc < 64: as s8)
  so[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))), f(sc));
  so[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16))), f(_mm_srli_si128(sc, 8)));
  so[2] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 32))), f(mn));
  so[3] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 48))), f(_mm_srli_si128(mn, 8)));
}

// The scales and offsets of block b of 32 inputs of a 4-bit stream whose current header is h:
// a group header's, or a K-quant super-block's sub-group b % 8
inline void header4(const uint8_t* h, int64_t b, const Header& hd, __m256* so) {
  if (hd.kq) load_kheader(h, b & 7, so);
  else load_header(h, so);
}

// R rows (1 or 2), one block b of 32 inputs, against the 4 chunks of 4-bit codes at p (one
// 16-row weight block's codes for those inputs; so: their group's scales and offsets): y0, y1
// (rows 0-7, 8-15 of each row's outputs) += the block's terms. The 4-bit kernel's arithmetic,
// which block4 (one weight block at a time) and block4_streams (several side by side) both run.
// ACT8: int8 activations (expand4 without q2: isum = the sum against q1 alone, half the
// vpmaddubsw).
template <int R, bool ACT8>
__attribute__((always_inline)) inline void sums4(const uint8_t* p, const RowArgs* rows, int64_t b, const __m256* so,
                                                 __m256* y0, __m256* y1) {
  const __m256i m0f = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1), w254 = _mm256_set1_epi16(254);
  // per 128-bit lane: words 0 4 1 5 2 6 3 7 (a row's k-pair 0 and k-pair 1 lanes side by side)
  const __m256i pairs = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  __m256i hA[R], hB[R], lA[R], lB[R];  // s16 sums against q1 (h) and q2 (l), rows 0-7 (A), 8-15 (B)
  for (int r = 0; r < R; ++r) hA[r] = hB[r] = lA[r] = lB[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c));
    const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32));
    const __m256i Alo = _mm256_and_si256(A, m0f), Ahi = _mm256_and_si256(_mm256_srli_epi16(A, 4), m0f);
    const __m256i Blo = _mm256_and_si256(B, m0f), Bhi = _mm256_and_si256(_mm256_srli_epi16(B, 4), m0f);
    for (int r = 0; r < R; ++r) {
      const __m256i* X = reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(rows[r].X) + (b * 4 + c) * (ACT8 ? 64 : 128));
      const __m256i X01 = _mm256_loadu_si256(X), X23 = _mm256_loadu_si256(X + 1);
      // (R = 1: the first chunk starts the sums; each sum right after its two products, an order
      // that keeps gcc from spilling at R = 2)
      const auto acc = [c](__m256i s, __m256i t) { return R == 1 && c == 0 ? t : _mm256_add_epi16(s, t); };
      hA[r] = acc(hA[r], _mm256_add_epi16(_mm256_maddubs_epi16(Alo, X01), _mm256_maddubs_epi16(Ahi, X23)));
      hB[r] = acc(hB[r], _mm256_add_epi16(_mm256_maddubs_epi16(Blo, X01), _mm256_maddubs_epi16(Bhi, X23)));
      if (ACT8) continue;
      const __m256i Y01 = _mm256_loadu_si256(X + 2), Y23 = _mm256_loadu_si256(X + 3);
      lA[r] = acc(lA[r], _mm256_add_epi16(_mm256_maddubs_epi16(Alo, Y01), _mm256_maddubs_epi16(Ahi, Y23)));
      lB[r] = acc(lB[r], _mm256_add_epi16(_mm256_maddubs_epi16(Blo, Y01), _mm256_maddubs_epi16(Bhi, Y23)));
    }
    // a compiler barrier per chunk: without it gcc reassociates the four chunks' integer adds into
    // one tree after all 32 (R = 1) or 64 (R = 2) vpmaddubsw, which spills ~20 vectors to the
    // stack a block (the same sums: integer adds are exact in any order)
    for (int r = 0; r < R; ++r) {
      asm("" : "+x"(hA[r]), "+x"(hB[r]));
      if (!ACT8) asm("" : "+x"(lA[r]), "+x"(lB[r]));
    }
  }
  for (int r = 0; r < R; ++r) {  // isum = 254 * (sum against q1) + (sum against q2), exact in s32
    if (ACT8) {
      epilogue(_mm256_madd_epi16(_mm256_shuffle_epi8(hA[r], pairs), ones),
               _mm256_madd_epi16(_mm256_shuffle_epi8(hB[r], pairs), ones), so, rows[r].dx[b], rows[r].qs[b], y0[r], y1[r]);
      continue;
    }
    const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_shuffle_epi8(hA[r], pairs), w254),
                                        _mm256_madd_epi16(_mm256_shuffle_epi8(lA[r], pairs), ones));
    const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_shuffle_epi8(hB[r], pairs), w254),
                                        _mm256_madd_epi16(_mm256_shuffle_epi8(lB[r], pairs), ones));
    epilogue(s0, s1, so, rows[r].dx[b], rows[r].qs[b], y0[r], y1[r]);
  }
}

// R rows (1 or 2) against one 16-row block of 4-bit codes (sums4 per block of 32 inputs).
template <int R, bool ACT8 = false>
inline void block4(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd) {
  __m256 y0[R], y1[R];
  for (int r = 0; r < R; ++r) y0[r] = y1[r] = _mm256_setzero_ps();
  const int64_t per_group = int64_t(1) << group_shift;  // blocks of 32 inputs a group (header)
  __m256 so[4];
  const uint8_t* h = w;
  const uint8_t* p = w;  // the stream: header, the group's blocks of codes, next header, ...
  for (int64_t b = 0; b < KB; ++b, p += 256) {
    if ((b & (per_group - 1)) == 0) {
      h = p;
      if (!hd.kq) load_header(h, so);
      p += hd.bytes;
    }
    if (hd.kq) load_kheader(h, b & 7, so);
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
    sums4<R, ACT8>(p, rows, b, so, y0, y1);
  }
  for (int r = 0; r < R; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y), from_float8(y0[r]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y + 8), from_float8(y1[r]));
  }
}

// 2 rows against one 16-row block of 4-bit codes (int16 activations; prefill tiles): sums4<2>'s
// integer sums, epilogue and rounding for each row, in the same order of float operations (a row's
// result is bitwise block4's; the s16 sums only add the same products in another order, exact).
// A chunk's work is written as asm with its 15 registers named: the 8 s16 sums, the 4 unpacked
// nibble vectors, one X vector (each loaded once for rows 0-7 and 8-15) and two products; gcc's
// own allocation of sums4<2> kept 3-4 of the sums on the stack (a store / load pair each a chunk).
// The float sums stay in memory between blocks, as in block8x4.
inline void block4x2(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd) {
  alignas(32) static const uint8_t k0f[32] = {
      15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
      15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
  alignas(32) float yacc[2][16];
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 16; ++i) yacc[r][i] = 0.0f;
  const __m256i ones = _mm256_set1_epi16(1), w254 = _mm256_set1_epi16(254);
  const __m256i pairs = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  const int64_t per_group = int64_t(1) << group_shift;
  const uint8_t* header = w;
  const uint8_t* p = w;
  const int8_t* X0 = static_cast<const int8_t*>(rows[0].X);
  const int8_t* X1 = static_cast<const int8_t*>(rows[1].X);
  for (int64_t b = 0; b < KB; ++b, p += 256) {
    if ((b & (per_group - 1)) == 0) {
      header = p;
      p += hd.bytes;
    }
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
    __m256i ha0 = _mm256_setzero_si256(), hb0 = ha0, la0 = ha0, lb0 = ha0, ha1 = ha0, hb1 = ha0, la1 = ha0, lb1 = ha0;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const int8_t* x0 = X0 + (b * 4 + c) * 128;
      const int8_t* x1 = X1 + (b * 4 + c) * 128;
      __m256i alo, ahi, blo, bhi, x, t1, t2;
      // h += (lo nibbles . X01) + (hi nibbles . X23), l likewise with Y01 / Y23 (q2), per row and
      // per half (A: output rows 0-7, B: 8-15)
#define SGRT_ROW4(xa, xb, xc, xd, ha, hb, la, lb)            \
  "vmovdqu " xa ", %[x]\n\t"                                 \
  "vpmaddubsw %[x], %[alo], %[t1]\n\t"                       \
  "vpmaddubsw %[x], %[blo], %[t2]\n\t"                       \
  "vmovdqu " xb ", %[x]\n\t"                                 \
  "vpaddw %[t1], " ha ", " ha "\n\t"                         \
  "vpaddw %[t2], " hb ", " hb "\n\t"                         \
  "vpmaddubsw %[x], %[ahi], %[t1]\n\t"                       \
  "vpmaddubsw %[x], %[bhi], %[t2]\n\t"                       \
  "vmovdqu " xc ", %[x]\n\t"                                 \
  "vpaddw %[t1], " ha ", " ha "\n\t"                         \
  "vpaddw %[t2], " hb ", " hb "\n\t"                         \
  "vpmaddubsw %[x], %[alo], %[t1]\n\t"                       \
  "vpmaddubsw %[x], %[blo], %[t2]\n\t"                       \
  "vmovdqu " xd ", %[x]\n\t"                                 \
  "vpaddw %[t1], " la ", " la "\n\t"                         \
  "vpaddw %[t2], " lb ", " lb "\n\t"                         \
  "vpmaddubsw %[x], %[ahi], %[t1]\n\t"                       \
  "vpmaddubsw %[x], %[bhi], %[t2]\n\t"                       \
  "vpaddw %[t1], " la ", " la "\n\t"                         \
  "vpaddw %[t2], " lb ", " lb "\n\t"
      asm("vmovdqa %[m0f], %[t1]\n\t"
          "vpand %[A], %[t1], %[alo]\n\t"
          "vpand %[B], %[t1], %[blo]\n\t"
          "vmovdqu %[A], %[ahi]\n\t"
          "vmovdqu %[B], %[bhi]\n\t"
          "vpsrlw $4, %[ahi], %[ahi]\n\t"
          "vpsrlw $4, %[bhi], %[bhi]\n\t"
          "vpand %[t1], %[ahi], %[ahi]\n\t"
          "vpand %[t1], %[bhi], %[bhi]\n\t"
          SGRT_ROW4("(%[x0])", "32(%[x0])", "64(%[x0])", "96(%[x0])", "%[ha0]", "%[hb0]", "%[la0]", "%[lb0]")
          SGRT_ROW4("(%[x1])", "32(%[x1])", "64(%[x1])", "96(%[x1])", "%[ha1]", "%[hb1]", "%[la1]", "%[lb1]")
          : [ha0] "+x"(ha0), [hb0] "+x"(hb0), [la0] "+x"(la0), [lb0] "+x"(lb0), [ha1] "+x"(ha1), [hb1] "+x"(hb1),
            [la1] "+x"(la1), [lb1] "+x"(lb1), [alo] "=&x"(alo), [ahi] "=&x"(ahi), [blo] "=&x"(blo), [bhi] "=&x"(bhi),
            [x] "=&x"(x), [t1] "=&x"(t1), [t2] "=&x"(t2)
          : [m0f] "m"(*reinterpret_cast<const __m256i*>(k0f)),
            [A] "m"(*reinterpret_cast<const __m256i*>(p + 64 * c)),
            [B] "m"(*reinterpret_cast<const __m256i*>(p + 64 * c + 32)), [x0] "r"(x0), [x1] "r"(x1)
          : "memory");  // (reads the rows' 128 bytes of X at x0, x1)
#undef SGRT_ROW4
    }
    const __m256i hA[2] = {ha0, ha1}, hB[2] = {hb0, hb1}, lA[2] = {la0, la1}, lB[2] = {lb0, lb1};
    __m256 so[4];
    header4(header, b, hd, so);
    for (int r = 0; r < 2; ++r) {  // isum = 254 * (sum against q1) + (sum against q2), as in sums4
      const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_shuffle_epi8(hA[r], pairs), w254),
                                          _mm256_madd_epi16(_mm256_shuffle_epi8(lA[r], pairs), ones));
      const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_shuffle_epi8(hB[r], pairs), w254),
                                          _mm256_madd_epi16(_mm256_shuffle_epi8(lB[r], pairs), ones));
      __m256 y0 = _mm256_load_ps(yacc[r]), y1 = _mm256_load_ps(yacc[r] + 8);
      epilogue(s0, s1, so, rows[r].dx[b], rows[r].qs[b], y0, y1);
      _mm256_store_ps(yacc[r], y0);
      _mm256_store_ps(yacc[r] + 8, y1);
    }
    asm volatile("" : : "r"(&yacc[0][0]) : "memory");
  }
  for (int r = 0; r < 2; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y), from_float8(_mm256_load_ps(yacc[r])));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y + 8), from_float8(_mm256_load_ps(yacc[r] + 8)));
  }
}

// 4 rows against one 16-row block of 4-bit codes with int16 activations (prefill tiles): the
// 8-bit kernel's arithmetic (block8x4) on the nibbles widened to words. Per chunk (4 k-pairs), the
// 32 bytes A (rows 0-7) unpacked against zero give per 128-bit lane the (parity 0, parity 1) word
// pairs of rows 0-3 / 4-7: vpunpcklbw k-pair 0 (low nibbles, masked) and 2 (high nibbles,
// shifted), vpunpckhbw k-pairs 1 and 3; B likewise rows 8-15. vpmaddwd with the broadcast int16
// pair (Q[2p], Q[2p+1]) then sums code * Q with Q = 254 q1 + q2, i.e. the same integer isum as
// block4's 254 * s1 + s2 (|isum| <= 32 * 15 * 32385 < 2^24: exact in s32 and in float), so a
// row's outputs are bitwise block4's (the same epilogue, in the same order). Reads the rows' Q in
// place (no expand4), and widens each weight vector once for 4 rows. The k loop is asm, as in
// block8x4 (15 registers named); the float sums stay in memory between blocks.
inline void block4x4w(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd) {
  alignas(32) static const uint8_t k0f[32] = {
      15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
      15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
  alignas(32) float yacc[4][16];
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 16; ++i) yacc[r][i] = 0.0f;
  const int64_t per_group = int64_t(1) << group_shift;
  const uint8_t* header = w;
  const uint8_t* p = w;
  const int16_t* X[4];
  for (int r = 0; r < 4; ++r) X[r] = static_cast<const int16_t*>(rows[r].X);
  for (int64_t b = 0; b < KB; ++b, p += 256) {
    if ((b & (per_group - 1)) == 0) {
      header = p;
      p += hd.bytes;
    }
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
            a31 = a00;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const uint8_t* pc = p + 64 * c;
      const int16_t* q0 = X[0] + 32 * b + 8 * c;
      const int16_t* q1 = X[1] + 32 * b + 8 * c;
      const int16_t* q2 = X[2] + 32 * b + 8 * c;
      const int16_t* q3 = X[3] + 32 * b + 8 * c;
      __m256i ra, rb, lo, hi, xp, t, z;
      // one row's k-pair: broadcast its int16 pair (at byte offset off), add the two vpmaddwd
      // products (rows 0-7: lo, 8-15: hi) to its sums
#define SGRT_ROW(off, q, s0, s1)                    \
  "vpbroadcastd " off "(%[" q "]), %[xp]\n\t"       \
  "vpmaddwd %[xp], %[lo], %[t]\n\t"                 \
  "vpaddd %[t], %[" s0 "], %[" s0 "]\n\t"           \
  "vpmaddwd %[xp], %[hi], %[t]\n\t"                 \
  "vpaddd %[t], %[" s1 "], %[" s1 "]\n\t"
      // k-pair j of the chunk: widen (unpack: vpunpcklbw / vpunpckhbw; nibble: vpand with 0x0f or
      // vpsrlw by 4), then the 4 rows
#define SGRT_KPAIR(unpack, nibble, off)                                                              \
  unpack " %[z], %[ra], %[lo]\n\t" unpack " %[z], %[rb], %[hi]\n\t" nibble ", %[lo], %[lo]\n\t" nibble \
  ", %[hi], %[hi]\n\t" SGRT_ROW(off, "q0", "a00", "a01") SGRT_ROW(off, "q1", "a10", "a11")              \
      SGRT_ROW(off, "q2", "a20", "a21") SGRT_ROW(off, "q3", "a30", "a31")
      asm("vpxor %[z], %[z], %[z]\n\t"
          "vmovdqu (%[p]), %[ra]\n\t"
          "vmovdqu 32(%[p]), %[rb]\n\t"
          SGRT_KPAIR("vpunpcklbw", "vpand %[m0f]", "0")  // k-pair 0: low nibbles of bytes 0-7 / 16-23
          SGRT_KPAIR("vpunpckhbw", "vpand %[m0f]", "4")  // 1: low nibbles of bytes 8-15 / 24-31
          SGRT_KPAIR("vpunpcklbw", "vpsrlw $4", "8")     // 2: high nibbles of bytes 0-7 / 16-23
          SGRT_KPAIR("vpunpckhbw", "vpsrlw $4", "12")    // 3: high nibbles of bytes 8-15 / 24-31
          : [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11), [a20] "+x"(a20), [a21] "+x"(a21),
            [a30] "+x"(a30), [a31] "+x"(a31), [ra] "=&x"(ra), [rb] "=&x"(rb), [lo] "=&x"(lo), [hi] "=&x"(hi),
            [xp] "=&x"(xp), [t] "=&x"(t), [z] "=&x"(z)
          : [m0f] "m"(*reinterpret_cast<const __m256i*>(k0f)), [p] "r"(pc), [q0] "r"(q0), [q1] "r"(q1), [q2] "r"(q2),
            [q3] "r"(q3)
          : "memory");  // (reads the chunk's 64 bytes at pc and 4 k-pairs of each row's Q)
#undef SGRT_KPAIR
#undef SGRT_ROW
    }
    const __m256i a0[4] = {a00, a10, a20, a30}, a1[4] = {a01, a11, a21, a31};
    __m256 so[4];
    header4(header, b, hd, so);
    for (int r = 0; r < 4; ++r) {
      __m256 y0 = _mm256_load_ps(yacc[r]), y1 = _mm256_load_ps(yacc[r] + 8);
      epilogue(a0[r], a1[r], so, rows[r].dx[b], rows[r].qs[b], y0, y1);
      _mm256_store_ps(yacc[r], y0);
      _mm256_store_ps(yacc[r] + 8, y1);
    }
    asm volatile("" : : "r"(&yacc[0][0]) : "memory");
  }
  for (int r = 0; r < 4; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y), from_float8(_mm256_load_ps(yacc[r])));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y + 8), from_float8(_mm256_load_ps(yacc[r] + 8)));
  }
}

// The read positions of S 16-row blocks streamed side by side (the one-row streams): p at each
// block's codes, h at its current group's header; enter(b, ...) at block b of 32 inputs steps over
// a new group's header (header_bytes) where one starts.
template <int S>
struct StreamPos {
  const uint8_t* p[S];
  const uint8_t* h[S];
  int64_t per_group;
  StreamPos(const uint8_t* const* w, int group_shift) : per_group(int64_t(1) << group_shift) {
    for (int s = 0; s < S; ++s) p[s] = h[s] = w[s];
  }
  void enter(int64_t b, int64_t header_bytes) {
    if ((b & (per_group - 1)) == 0)
      for (int s = 0; s < S; ++s) {
        h[s] = p[s];
        p[s] += header_bytes;
      }
  }
};

// One row of x against S 16-row blocks of 4-bit codes at once, far apart in the weight stream
// (decode: see STREAMS4): per block b of 32 inputs, sums4<1> on each block's codes in turn, so the
// S blocks' streams advance together; each block's outputs are bitwise block4<1>'s (the same
// instructions on the same values; a group's scales are widened again from its header, in L1,
// rather than held in 4 x S registers).
template <int S, bool ACT8>
inline void block4_streams(const uint8_t* const* w, const RowArgs& row, uint16_t* const* y, int64_t KB,
                           int group_shift, const Header& hd) {
  __m256 y0[S], y1[S];
  for (int s = 0; s < S; ++s) y0[s] = y1[s] = _mm256_setzero_ps();
  StreamPos<S> at(w, group_shift);
  const uint8_t* const* const h = at.h;
  const uint8_t** const p = at.p;
  for (int64_t b = 0; b < KB; ++b) {
    at.enter(b, hd.bytes);
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      if (STREAM4_PREFETCH)
        for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p[s] + STREAM4_PREFETCH + 64 * l), SGRT_PREFETCH_HINT);
      __m256 so[4];
      header4(h[s], b, hd, so);
      sums4<1, ACT8>(p[s], &row, b, so, &y0[s], &y1[s]);
      p[s] += 256;
    }
  }
  for (int s = 0; s < S; ++s) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[s]), from_float8(y0[s]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[s] + 8), from_float8(y1[s]));
  }
}

// The 16-row blocks [b0, b1) of a weight stream (block_bytes each; outputs at yp, BLOCK_N a block)
// cut into S equal contiguous parts walked side by side: streams(w, y) takes block i of every part
// together (w[s], y[s]: part s's block and its outputs), one(w, y) each block left over alone.
// The one-row split of both code widths (row4_streams, row8_streams).
template <int S, typename Streams, typename One>
inline void walk_streams(const uint8_t* wp, int64_t block_bytes, int64_t b0, int64_t b1, uint16_t* yp,
                         Streams&& streams, One&& one) {
  const int64_t part = (b1 - b0) / S;
  for (int64_t i = 0; i < part; ++i) {
    const uint8_t* w[S];
    uint16_t* y[S];
    for (int s = 0; s < S; ++s) {
      w[s] = wp + (b0 + s * part + i) * block_bytes;
      y[s] = yp + (b0 + s * part + i) * BLOCK_N;
    }
    streams(w, y);
  }
  for (int64_t b = b0 + S * part; b < b1; ++b) one(wp + b * block_bytes, yp + b * BLOCK_N);
}

// One row of x (row.X: its expand4 vectors) against the 16-row blocks [b0, b1) of a 4-bit weight
// stream: STREAMS4 parts side by side (block4_streams), the blocks left over by block4<1>.
template <bool ACT8>
void row4_streams(const uint8_t* wp, int64_t block_bytes, int64_t b0, int64_t b1, const RowArgs& row,
                  uint16_t* yp, int64_t KB, int group_shift, const Header& hd) {
  walk_streams<STREAMS4>(
      wp, block_bytes, b0, b1, yp,
      [&](const uint8_t* const* w, uint16_t* const* y) { block4_streams<STREAMS4, ACT8>(w, row, y, KB, group_shift, hd); },
      [&](const uint8_t* w, uint16_t* y) {
        const RowArgs rows[1] = {{row.X, row.dx, row.qs, y}};
        block4<1, ACT8>(w, rows, KB, group_shift, hd);
      });
}

// R rows (1 or 2) against one 16-row block of 8-bit codes.
template <int R>
inline void block8(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd) {
  __m256 y0[R], y1[R];
  for (int r = 0; r < R; ++r) y0[r] = y1[r] = _mm256_setzero_ps();
  const int64_t per_group = int64_t(1) << group_shift;
  __m256 so[4];
  const uint8_t* p = w;
  for (int64_t b = 0; b < KB; ++b, p += 512) {  // 16 k-pairs x 32 bytes a block of 32 inputs
    if ((b & (per_group - 1)) == 0) {
      load_header(p, so, hd);
      p += hd.bytes;
    }
    __m256i a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
    for (int l = 0; l < 8; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * j)));
      const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * j + 16)));
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // (q[2p], q[2p + 1]) as int16
        std::memcpy(&pair, static_cast<const int16_t*>(rows[r].X) + 2 * (b * 16 + j), 4);
        const __m256i xp = _mm256_set1_epi32(pair);
        a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(lo, xp));
        a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(hi, xp));
      }
    }
    for (int r = 0; r < R; ++r) epilogue(a0[r], a1[r], so, rows[r].dx[b], rows[r].qs[b], y0[r], y1[r]);
  }
  for (int r = 0; r < R; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y), from_float8(y0[r]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y + 8), from_float8(y1[r]));
  }
}

// One row of x against STREAMS 16-row blocks of 8-bit codes at once, far apart in the weight stream
// (decode: see linear_raw). Each block's arithmetic is block8<1>'s, in the same order (the integer
// sums are exact in any order; the float32 epilogue is the same instructions), so the outputs are
// bitwise those of one block at a time; the k-pairs of the S blocks are read side by side, one
// broadcast of x serving all S.
template <int S>
inline void block8_streams(const uint8_t* const* w, const RowArgs& row, uint16_t* const* y, int64_t KB,
                           int group_shift, const Header& hd) {
  __m256 y0[S], y1[S];
  for (int s = 0; s < S; ++s) y0[s] = y1[s] = _mm256_setzero_ps();
  StreamPos<S> at(w, group_shift);  // (a group's header is read again per block of 32: in L1)
  const uint8_t* const* const h = at.h;
  const uint8_t** const p = at.p;
  const int16_t* const X = static_cast<const int16_t*>(row.X);
  for (int64_t b = 0; b < KB; ++b) {
    at.enter(b, hd.bytes);
    __m256i a0[S], a1[S];
    for (int s = 0; s < S; ++s) a0[s] = a1[s] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int j = 0; j < 16; ++j) {
      int32_t pair;  // (q[2p], q[2p + 1]) as int16
      std::memcpy(&pair, X + 2 * (b * 16 + j), 4);
      const __m256i xp = _mm256_set1_epi32(pair);
      for (int s = 0; s < S; ++s) {
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[s] + 32 * j)));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[s] + 32 * j + 16)));
        a0[s] = _mm256_add_epi32(a0[s], _mm256_madd_epi16(lo, xp));
        a1[s] = _mm256_add_epi32(a1[s], _mm256_madd_epi16(hi, xp));
      }
    }
    for (int s = 0; s < S; ++s) {
      __m256 so[4];
      load_header(h[s], so, hd);
      epilogue(a0[s], a1[s], so, row.dx[b], row.qs[b], y0[s], y1[s]);
      p[s] += 512;
    }
  }
  for (int s = 0; s < S; ++s) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[s]), from_float8(y0[s]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[s] + 8), from_float8(y1[s]));
  }
}

// One row of x against the 16-row blocks [b0, b1) of an 8-bit weight stream: STREAMS8 parts side by
// side (block8_streams), the blocks left over by block8<1>.
void row8_streams(const uint8_t* wp, int64_t block_bytes, int64_t b0, int64_t b1, const RowArgs& row,
                  uint16_t* yp, int64_t KB, int group_shift, const Header& hd) {
  walk_streams<STREAMS8>(
      wp, block_bytes, b0, b1, yp,
      [&](const uint8_t* const* w, uint16_t* const* y) { block8_streams<STREAMS8>(w, row, y, KB, group_shift, hd); },
      [&](const uint8_t* w, uint16_t* y) {
        const RowArgs rows[1] = {{row.X, row.dx, row.qs, y}};
        block8<1>(w, rows, KB, group_shift, hd);
      });
}

// ---- AVX-512 VNNI versions of the one-row streams (decode) -------------------------------------
// On CPUs with AVX-512 BW / VL / VNNI (has_avx512_vnni) the one-row streams run on 512-bit vectors:
// a 16-row block's 4-bit chunk (64 bytes: rows 0-7 in A, 8-15 in B) is one vector, so a chunk's
// vpmaddubsw against X01 / X23 (broadcast to both halves) do sums4's A and B work in half the
// instructions; the 8-bit codes' k-pair (32 bytes, rows 0-15) widens to one vector of 32 words
// and one vpdpwssd adds its products into the row sums (block8's vpmaddwd + vpaddd twice). The
// integer sums are the same exact values (only grouped otherwise: every partial sum stays within
// the bounds the AVX2 kernel's comment proves), the lanes come out in the same row order (the low
// 256 bits rows 0-7, the high rows 8-15), and the float32 epilogue is the same operations in the
// same order on 16 lanes instead of 2 x 8: outputs bitwise the AVX2 path's (tests compare both).
// SGRT_WOQ_AVX512=0 (read once) keeps the AVX2 streams, for A/B in one process tree.
#ifndef SGRT_WOQ4_STREAM_PREFETCH512
#define SGRT_WOQ4_STREAM_PREFETCH512 2048
#endif
constexpr int64_t STREAM4_PREFETCH512 = SGRT_WOQ4_STREAM_PREFETCH512;
#define SGRT_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

bool has_avx512_vnni() {
  static const bool ok = [] {
    const char* e = std::getenv("SGRT_WOQ_AVX512");
    if (e && std::strcmp(e, "0") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

// y (16 rows) += dx * (scale * isum + offset * qsum): epilogue's operations, in its order, on the
// 16 rows at once (sc, of: the group's 16 scales and offsets in fp32)
SGRT_TARGET_AVX512 inline __m512 epilogue512(__m512i s, __m512 sc, __m512 of, float dx, float qs, __m512 y) {
  __m512 t = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(s));
  t = _mm512_add_ps(t, _mm512_mul_ps(of, _mm512_set1_ps(qs)));
  return _mm512_add_ps(y, _mm512_mul_ps(_mm512_set1_ps(dx), t));
}

// 16 fp32 outputs -> bf16 (from_float8's rounding, per half)
SGRT_TARGET_AVX512 inline void store_bf16_512(uint16_t* y, __m512 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), from_float8(_mm512_castps512_ps256(v)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 8), from_float8(_mm512_extractf32x8_ps(v, 1)));
}

// A group header -> its 16 scales and 16 offsets as fp32 (load_header's values: stored offsets,
// or scale * (-c) for the compact header)
SGRT_TARGET_AVX512 inline void load_header16(const uint8_t* h, const Header& hd, __m512& sc, __m512& of) {
  sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  of = hd.negc == 0.0f ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)))
                       : _mm512_mul_ps(sc, _mm512_set1_ps(hd.negc));
}

// load_kheader's values as two 16-lane vectors (sub-group j of a K-quant super-block header h)
SGRT_TARGET_AVX512 inline void load_kheader16(const uint8_t* h, int64_t j, __m512& sc, __m512& of) {
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 64 + 16 * j));
  const __m128i m = _mm_sub_epi8(_mm_setzero_si128(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 192 + 16 * j)));
  sc = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))),
                     _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)));
  of = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32))),
                     _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(m)));
}

// header4 on 16-lane vectors
SGRT_TARGET_AVX512 inline void header4_16(const uint8_t* h, int64_t b, const Header& hd, __m512& sc, __m512& of) {
  if (hd.kq) load_kheader16(h, b & 7, sc, of);
  else load_header16(h, hd, sc, of);
}

// One chunk's activation vectors (expand4's X01 / X23 of q1, Y01 / Y23 of q2; no q2 for int8
// activations), each broadcast to both halves so that rows 0-7 and 8-15 share it.
struct Acts512 {
  __m512i x01, x23, y01, y23;
};
template <bool ACT8>
SGRT_TARGET_AVX512 inline Acts512 load_acts512(const int8_t* X0, int64_t chunk) {
  const __m256i* X = reinterpret_cast<const __m256i*>(X0 + chunk * (ACT8 ? 64 : 128));
  Acts512 a;
  a.x01 = _mm512_broadcast_i64x4(_mm256_loadu_si256(X));
  a.x23 = _mm512_broadcast_i64x4(_mm256_loadu_si256(X + 1));
  if (!ACT8) {
    a.y01 = _mm512_broadcast_i64x4(_mm256_loadu_si256(X + 2));
    a.y23 = _mm512_broadcast_i64x4(_mm256_loadu_si256(X + 3));
  }
  return a;
}

// h += (lo . X01) + (hi . X23), l likewise against Y01 / Y23 (vpmaddubsw: s16 pair sums per row)
template <bool ACT8>
SGRT_TARGET_AVX512 inline void add_chunk512(__m512i& h, __m512i& l, __m512i lo, __m512i hi, const Acts512& a) {
  h = _mm512_add_epi16(h, _mm512_add_epi16(_mm512_maddubs_epi16(lo, a.x01), _mm512_maddubs_epi16(hi, a.x23)));
  if (!ACT8) l = _mm512_add_epi16(l, _mm512_add_epi16(_mm512_maddubs_epi16(lo, a.y01), _mm512_maddubs_epi16(hi, a.y23)));
}

// block4_streams on 512-bit vectors: S 16-row blocks of 4-bit codes, one row (row.X: expand4's
// vectors), per block of 32 inputs each block's 4 chunks in turn.
template <int S, bool ACT8>
SGRT_TARGET_AVX512 inline void block4_streams512(const uint8_t* const* w, const RowArgs& row, uint16_t* const* y,
                                                 int64_t KB, int group_shift, const Header& hd) {
  const __m512i m0f = _mm512_set1_epi8(0x0f);
  const __m512i ones = _mm512_set1_epi16(1), w254 = _mm512_set1_epi16(254);
  // per 128-bit lane: words 0 4 1 5 2 6 3 7 (sums4's `pairs`)
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  __m512 acc[S];
  for (int s = 0; s < S; ++s) acc[s] = _mm512_setzero_ps();
  StreamPos<S> at(w, group_shift);
  const uint8_t* const* const h = at.h;
  const uint8_t** const p = at.p;
  const int8_t* const X0 = static_cast<const int8_t*>(row.X);
  for (int64_t b = 0; b < KB; ++b) {
    at.enter(b, hd.bytes);
    __m512i hs[S], ls[S];  // s16 sums against q1 (h) and q2 (l), rows 0-7 low half, 8-15 high
    for (int s = 0; s < S; ++s) hs[s] = ls[s] = _mm512_setzero_si512();
    if (STREAM4_PREFETCH512)
      for (int s = 0; s < S; ++s)
        for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p[s] + STREAM4_PREFETCH512 + 64 * l), SGRT_PREFETCH_HINT);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const Acts512 a = load_acts512<ACT8>(X0, b * 4 + c);
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        const __m512i W = _mm512_loadu_si512(p[s] + 64 * c);
        const __m512i lo = _mm512_and_si512(W, m0f), hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), m0f);
        add_chunk512<ACT8>(hs[s], ls[s], lo, hi, a);
      }
    }
    for (int s = 0; s < S; ++s) {
      // isum = 254 * (sum against q1) + (sum against q2), exact in s32
      const __m512i hsum = _mm512_shuffle_epi8(hs[s], pairs);
      const __m512i isum = ACT8 ? _mm512_madd_epi16(hsum, ones)
                                : _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_shuffle_epi8(ls[s], pairs), ones), hsum, w254);
      __m512 sc, of;
      header4_16(h[s], b, hd, sc, of);
      acc[s] = epilogue512(isum, sc, of, row.dx[b], row.qs[b], acc[s]);
      p[s] += 256;
    }
  }
  for (int s = 0; s < S; ++s) store_bf16_512(y[s], acc[s]);
}

// row4_streams with block4_streams512 (the blocks left over: block4_streams512<1>, the same bits)
template <bool ACT8>
SGRT_TARGET_AVX512 __attribute__((noinline)) void row4_streams512(const uint8_t* wp, int64_t block_bytes, int64_t b0,
                                                                  int64_t b1, const RowArgs& row, uint16_t* yp,
                                                                  int64_t KB, int group_shift, const Header& hd) {
  walk_streams<STREAMS4>(
      wp, block_bytes, b0, b1, yp,
      [&](const uint8_t* const* w, uint16_t* const* y) { block4_streams512<STREAMS4, ACT8>(w, row, y, KB, group_shift, hd); },
      [&](const uint8_t* w, uint16_t* y) { block4_streams512<1, ACT8>(&w, row, &y, KB, group_shift, hd); });
}

// block8_streams on 512-bit vectors: per k-pair one vpmovzxbw of the block's 32 bytes (rows 0-15 as
// (parity 0, parity 1) word pairs) and one vpdpwssd with the broadcast pair (Q[2p], Q[2p+1]).
template <int S>
SGRT_TARGET_AVX512 inline void block8_streams512(const uint8_t* const* w, const RowArgs& row, uint16_t* const* y,
                                                 int64_t KB, int group_shift, const Header& hd) {
  __m512 acc[S];
  for (int s = 0; s < S; ++s) acc[s] = _mm512_setzero_ps();
  StreamPos<S> at(w, group_shift);
  const uint8_t* const* const h = at.h;
  const uint8_t** const p = at.p;
  const int16_t* const X = static_cast<const int16_t*>(row.X);
  for (int64_t b = 0; b < KB; ++b) {
    at.enter(b, hd.bytes);
    __m512i a[S];
    for (int s = 0; s < S; ++s) a[s] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      int32_t pair;  // (q[2p], q[2p + 1]) as int16
      std::memcpy(&pair, X + 2 * (b * 16 + j), 4);
      const __m512i xp = _mm512_set1_epi32(pair);
      for (int s = 0; s < S; ++s)
        a[s] = _mm512_dpwssd_epi32(a[s], _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[s] + 32 * j))), xp);
    }
    for (int s = 0; s < S; ++s) {
      __m512 sc, of;
      load_header16(h[s], hd, sc, of);
      acc[s] = epilogue512(a[s], sc, of, row.dx[b], row.qs[b], acc[s]);
      p[s] += 512;
    }
  }
  for (int s = 0; s < S; ++s) store_bf16_512(y[s], acc[s]);
}

// row8_streams with block8_streams512 (the blocks left over: block8_streams512<1>)
SGRT_TARGET_AVX512 __attribute__((noinline)) void row8_streams512(const uint8_t* wp, int64_t block_bytes, int64_t b0,
                                                                  int64_t b1, const RowArgs& row, uint16_t* yp,
                                                                  int64_t KB, int group_shift, const Header& hd) {
  walk_streams<STREAMS8>(
      wp, block_bytes, b0, b1, yp,
      [&](const uint8_t* const* w, uint16_t* const* y) { block8_streams512<STREAMS8>(w, row, y, KB, group_shift, hd); },
      [&](const uint8_t* w, uint16_t* y) { block8_streams512<1>(&w, row, &y, KB, group_shift, hd); });
}

// ---- 5-bit codes (a GGUF's Q5_0 blocks as they are) ----------------------------------------------
// Stream (the `bits` argument 5 + 256 c; woq.py's fuse5): per 16-row block and group the header of
// the 8-bit streams (compact where c > 0), then per block of 32 inputs FIVE_BYTES bytes: the codes'
// low 4 bits as the 4-bit layout's 4 chunks (256 bytes), then their fifth bits as two 64-bit masks
// per chunk (bit j: the fifth bit of the code in the low nibble of the chunk's byte j, then of the
// one in its high nibble; 64 bytes); after the last block, the 8-bit stream of the same codes.
// One row on AVX-512 VNNI CPUs reads the 5-bit part (0.65x the 8-bit stream's bytes: decode is
// memory-bound) with the same integer sums: a code is (low 4 bits) + 16 * (fifth bit), so the
// 4-bit kernel's vpmaddubsw on the nibbles with 16 added where the fifth bit is set (a byte-masked
// add) gives sum code * q exactly, and the float32 epilogue is the 8-bit kernel's: outputs bitwise
// those of the 8-bit stream. More rows (compute-bound: vpdpwssd on 8-bit codes does more products
// an instruction than vpmaddubsw on nibbles, and expanding the 5-bit codes per call cost 1.2-1.6x
// the 8-bit kernel's time at 2-64 rows), or no AVX-512, read the 8-bit part (linear_blocks5).
constexpr int64_t FIVE_BYTES = 320;  // a 16-row block's 32 inputs: 256 bytes of nibbles, 64 of fifth bits

// The nibbles of a 64-byte chunk W with 16 added in the bytes whose mask bit is set: the 5-bit codes
// of its low (lo) and high (hi) nibbles, in the 4-bit layout's byte order
SGRT_TARGET_AVX512 inline void codes5(const uint8_t* chunk, const uint8_t* masks, __m512i& lo, __m512i& hi) {
  const __m512i m0f = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
  const __m512i W = _mm512_loadu_si512(chunk);
  uint64_t mlo, mhi;
  std::memcpy(&mlo, masks, 8);
  std::memcpy(&mhi, masks + 8, 8);
  lo = _mm512_and_si512(W, m0f);
  hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), m0f);
  lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(mlo), lo, sixteen);
  hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(mhi), hi, sixteen);
}

// One row (row.X: expand4's vectors) against S 16-row blocks of 5-bit codes side by side (decode):
// block4_streams512's sums on codes5's codes. A 16-bit lane adds two products of at most 31 * 127
// per vpmaddubsw; two chunks' four such sums stay within 4 * 7874 = 31496 < 2^15, so the lanes are
// widened to the s32 row sums every two chunks (the 4-bit kernel: every four).
template <int S, bool ACT8>
SGRT_TARGET_AVX512 inline void block5_streams512(const uint8_t* const* w, const RowArgs& row, uint16_t* const* y,
                                                 int64_t KB, int group_shift, const Header& hd) {
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  __m512 acc[S];
  for (int s = 0; s < S; ++s) acc[s] = _mm512_setzero_ps();
  StreamPos<S> at(w, group_shift);
  const uint8_t* const* const h = at.h;
  const uint8_t** const p = at.p;
  const int8_t* const X0 = static_cast<const int8_t*>(row.X);
  for (int64_t b = 0; b < KB; ++b) {
    at.enter(b, hd.bytes);
    if (STREAM4_PREFETCH512)
      for (int s = 0; s < S; ++s)
        for (int l = 0; l < 5; ++l) _mm_prefetch(reinterpret_cast<const char*>(p[s] + STREAM4_PREFETCH512 + 64 * l), SGRT_PREFETCH_HINT);
    __m512i s1[S], s2[S];  // s32 row sums against q1 and q2 (rows 0-7 low half, 8-15 high)
    for (int s = 0; s < S; ++s) s1[s] = s2[s] = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      __m512i hs[S], ls[S];
      for (int s = 0; s < S; ++s) hs[s] = ls[s] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int c = 2 * half; c < 2 * half + 2; ++c) {
        const Acts512 a = load_acts512<ACT8>(X0, b * 4 + c);
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) {
          __m512i lo, hi;
          codes5(p[s] + 64 * c, p[s] + 256 + 16 * c, lo, hi);
          add_chunk512<ACT8>(hs[s], ls[s], lo, hi, a);
        }
      }
      for (int s = 0; s < S; ++s) {
        s1[s] = _mm512_add_epi32(s1[s], _mm512_madd_epi16(_mm512_shuffle_epi8(hs[s], pairs), ones));
        if (!ACT8) s2[s] = _mm512_add_epi32(s2[s], _mm512_madd_epi16(_mm512_shuffle_epi8(ls[s], pairs), ones));
      }
    }
    for (int s = 0; s < S; ++s) {
      // isum = 254 * (sum against q1) + (sum against q2), exact in s32 (|s1| <= 32 * 31 * 127)
      const __m512i isum = ACT8 ? s1[s] : _mm512_add_epi32(_mm512_mullo_epi32(s1[s], _mm512_set1_epi32(254)), s2[s]);
      __m512 sc, of;
      load_header16(h[s], hd, sc, of);
      acc[s] = epilogue512(isum, sc, of, row.dx[b], row.qs[b], acc[s]);
      p[s] += FIVE_BYTES;
    }
  }
  for (int s = 0; s < S; ++s) store_bf16_512(y[s], acc[s]);
}

// One row against the 16-row blocks [b0, b1) of a 5-bit stream: STREAMS4 parts side by side
// (block5_streams512), the blocks left over one by one
template <bool ACT8>
SGRT_TARGET_AVX512 __attribute__((noinline)) void row5_streams512(const uint8_t* wp, int64_t block_bytes, int64_t b0,
                                                                  int64_t b1, const RowArgs& row, uint16_t* yp,
                                                                  int64_t KB, int group_shift, const Header& hd) {
  walk_streams<STREAMS4>(
      wp, block_bytes, b0, b1, yp,
      [&](const uint8_t* const* w, uint16_t* const* y) {
        block5_streams512<STREAMS4, ACT8>(w, row, y, KB, group_shift, hd);
      },
      [&](const uint8_t* w, uint16_t* y) { block5_streams512<1, ACT8>(&w, row, &y, KB, group_shift, hd); });
}

// 4 rows against one 16-row block of 8-bit codes: block8's integer sums, epilogue and rounding
// for each row, in the same order (a row's result is bitwise block8's), with each weight vector
// widened once for 4 rows instead of 2. Register budget: the 8 integer sums, the two widened
// vectors and one broadcast pair; the float sums (y) and the group's scales stay in memory
// between blocks (with them in registers gcc spilled an integer sum inside the k loop: a
// store-to-load chain every k-pair, 1.4x block8<2>'s time).
inline void block8x4(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd) {
  alignas(32) float yacc[4][16];
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 16; ++i) yacc[r][i] = 0.0f;
  const int64_t per_group = int64_t(1) << group_shift;
  const uint8_t* header = w;
  const uint8_t* p = w;
  const int16_t* X[4];
  for (int r = 0; r < 4; ++r) X[r] = static_cast<const int16_t*>(rows[r].X);
  for (int64_t b = 0; b < KB; ++b, p += 512) {
    if ((b & (per_group - 1)) == 0) {
      header = p;
      p += hd.bytes;
    }
    // (named sums, not arrays: gcc kept arrays of them on the stack)
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
            a31 = a00;
    for (int l = 0; l < 8; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
    const int16_t* x0 = X[0] + 32 * b;
    const int16_t* x1 = X[1] + 32 * b;
    const int16_t* x2 = X[2] + 32 * b;
    const int16_t* x3 = X[3] + 32 * b;
    // one k-pair: widen its 32 codes (rows 0-7, 8-15) once, then per row broadcast the s16 pair
    // (q[2p], q[2p + 1]) and add the two vpmaddwd products to the row's sums. Written as asm:
    // gcc's own allocation of these 12 registers spilled sums or copied them every k-pair.
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      __m256i lo, hi, xp, t;
      asm("vpmovzxbw %[w0], %[lo]\n\t"
          "vpmovzxbw %[w1], %[hi]\n\t"
          "vpbroadcastd %[q0], %[xp]\n\t"
          "vpmaddwd %[xp], %[lo], %[t]\n\t"
          "vpaddd %[t], %[a00], %[a00]\n\t"
          "vpmaddwd %[xp], %[hi], %[t]\n\t"
          "vpaddd %[t], %[a01], %[a01]\n\t"
          "vpbroadcastd %[q1], %[xp]\n\t"
          "vpmaddwd %[xp], %[lo], %[t]\n\t"
          "vpaddd %[t], %[a10], %[a10]\n\t"
          "vpmaddwd %[xp], %[hi], %[t]\n\t"
          "vpaddd %[t], %[a11], %[a11]\n\t"
          "vpbroadcastd %[q2], %[xp]\n\t"
          "vpmaddwd %[xp], %[lo], %[t]\n\t"
          "vpaddd %[t], %[a20], %[a20]\n\t"
          "vpmaddwd %[xp], %[hi], %[t]\n\t"
          "vpaddd %[t], %[a21], %[a21]\n\t"
          "vpbroadcastd %[q3], %[xp]\n\t"
          "vpmaddwd %[xp], %[lo], %[t]\n\t"
          "vpaddd %[t], %[a30], %[a30]\n\t"
          "vpmaddwd %[xp], %[hi], %[t]\n\t"
          "vpaddd %[t], %[a31], %[a31]"
          : [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11), [a20] "+x"(a20), [a21] "+x"(a21),
            [a30] "+x"(a30), [a31] "+x"(a31), [lo] "=&x"(lo), [hi] "=&x"(hi), [xp] "=&x"(xp), [t] "=&x"(t)
          : [w0] "m"(*reinterpret_cast<const __m128i*>(p + 32 * j)),
            [w1] "m"(*reinterpret_cast<const __m128i*>(p + 32 * j + 16)),
            [q0] "m"(*reinterpret_cast<const int32_t*>(x0 + 2 * j)), [q1] "m"(*reinterpret_cast<const int32_t*>(x1 + 2 * j)),
            [q2] "m"(*reinterpret_cast<const int32_t*>(x2 + 2 * j)), [q3] "m"(*reinterpret_cast<const int32_t*>(x3 + 2 * j)));
    }
    const __m256i a0[4] = {a00, a10, a20, a30}, a1[4] = {a01, a11, a21, a31};
    __m256 so[4];
    load_header(header, so, hd);
    for (int r = 0; r < 4; ++r) {
      __m256 y0 = _mm256_load_ps(yacc[r]), y1 = _mm256_load_ps(yacc[r] + 8);
      epilogue(a0[r], a1[r], so, rows[r].dx[b], rows[r].qs[b], y0, y1);
      _mm256_store_ps(yacc[r], y0);
      _mm256_store_ps(yacc[r] + 8, y1);
    }
    // yacc stays in memory across blocks (its address escapes here)
    asm volatile("" : : "r"(&yacc[0][0]) : "memory");
  }
  for (int r = 0; r < 4; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y), from_float8(_mm256_load_ps(yacc[r])));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y + 8), from_float8(_mm256_load_ps(yacc[r] + 8)));
  }
}

// ---- AVX-512 VNNI prefill tiles -------------------------------------------------------------------
// Where the CPU has AVX-512 VNNI (BW, VL), the multi-row tiles (block4x4w, block8x4) run as 512-bit
// kernels: a 16-row weight block's k-pair widened to words fills one zmm (rows 0-15 in order), and
// one vpdpwssd per row of x (its int16 pair (Q[2p], Q[2p+1]) broadcast from memory) adds the 16
// row sums: the same exact integer isum as the AVX2 kernels (pair products summed in s32, bounded
// as there), then epilogue's float operations lane for lane in the same order (epilogue512), so a
// row's outputs are bitwise the AVX2 path's. Rows 16 at a time per weight load (block_512i, on
// interleaved activations), then 8, then 4 (block4w_512 / block8_512). The
// functions carry their own target attribute (the file is built with -mavx2) and run only where
// has_avx512_vnni() says so; SGRT_WOQ_AVX512=0 turns them off (A/B in one process tree).

// The s16 pair (Q[2p], Q[2p+1]) at q, in every s32 lane (gcc folds it into vpdpwssd's {1to16})
SGRT_TARGET_AVX512 inline __m512i pair16(const int16_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

// The 16 float sums of each of R rows -> their bf16 outputs (from_float8 on each half)
template <int R>
SGRT_TARGET_AVX512 inline void store16(const __m512* y, const RowArgs* rows) {
  for (int r = 0; r < R; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y), from_float8(_mm512_castps512_ps256(y[r])));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows[r].y + 8), from_float8(_mm512_extractf32x8_ps(y[r], 1)));
  }
}

// R rows against one 16-row block of 4-bit codes, int16 activations (block4x4w's computation).
// A chunk's 64 bytes in one zmm: vpunpcklbw against zero gives, per 128-bit lane, the word pairs
// of rows 0-3, 4-7, 8-11, 12-15 of k-pairs 0 (low nibbles: vpand 0x0f) and 2 (high: vpsrlw 4),
// vpunpckhbw those of k-pairs 1 and 3.
template <int R>
SGRT_TARGET_AVX512 void block4w_512(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd) {
  const __m512i m0f = _mm512_set1_epi8(0x0f), z = _mm512_setzero_si512();
  __m512 y[R], sc, of;
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const int64_t per_group = int64_t(1) << group_shift;
  const uint8_t* h = w;
  const uint8_t* p = w;
  for (int64_t b = 0; b < KB; ++b, p += 256) {
    if ((b & (per_group - 1)) == 0) {
      h = p;
      if (!hd.kq) load_header16(h, hd, sc, of);
      p += hd.bytes;
    }
    if (hd.kq) load_kheader16(h, b & 7, sc, of);
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
    __m512i a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(p + 64 * c);
      const __m512i lo = _mm512_unpacklo_epi8(v, z), hi = _mm512_unpackhi_epi8(v, z);
      const __m512i kp[4] = {_mm512_and_si512(lo, m0f), _mm512_and_si512(hi, m0f), _mm512_srli_epi16(lo, 4),
                             _mm512_srli_epi16(hi, 4)};
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r)
          a[r] = _mm512_dpwssd_epi32(a[r], kp[j], pair16(static_cast<const int16_t*>(rows[r].X) + 32 * b + 8 * c + 2 * j));
    }
    for (int r = 0; r < R; ++r) y[r] = epilogue512(a[r], sc, of, rows[r].dx[b], rows[r].qs[b], y[r]);
  }
  store16<R>(y, rows);
}

// R rows against one 16-row block of 8-bit codes (block8x4's computation): a k-pair's 32 bytes
// widened (vpmovzxbw) are the word pairs of rows 0-15.
template <int R>
SGRT_TARGET_AVX512 void block8_512(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd) {
  __m512 y[R], sc, of;
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const int64_t per_group = int64_t(1) << group_shift;
  const uint8_t* p = w;
  for (int64_t b = 0; b < KB; ++b, p += 512) {
    if ((b & (per_group - 1)) == 0) {
      load_header16(p, hd, sc, of);
      p += hd.bytes;
    }
    for (int l = 0; l < 8; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
    __m512i a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
      for (int r = 0; r < R; ++r)
        a[r] = _mm512_dpwssd_epi32(a[r], v, pair16(static_cast<const int16_t*>(rows[r].X) + 32 * b + 2 * j));
    }
    for (int r = 0; r < R; ++r) y[r] = epilogue512(a[r], sc, of, rows[r].dx[b], rows[r].qs[b], y[r]);
  }
  store16<R>(y, rows);
}

// 16 rows of int16 activations (row r at Q + r * k) with their pairs interleaved: pair p of row r
// at Qi[16 p + r], so that block8_512i reads all 16 rows through one pointer
inline void interleave16(const int16_t* Q, int64_t k, int32_t* Qi) {
  for (int64_t p = 0; p < k / 2; ++p)
    for (int r = 0; r < 16; ++r) std::memcpy(Qi + 16 * p + r, Q + r * k + 2 * p, 4);
}

// 16 rows a weight load on interleave16's activations (qi): block8_512<16> (BITS 8) or
// block4w_512<16> (BITS 4), one pointer for the 16 rows' pairs where 16 row pointers do not fit the
// 16 general registers (gcc reloaded them from the stack before each broadcast); the float sums in
// memory between blocks (16 integer sums take half the 32 vector registers)
template <int BITS>
SGRT_TARGET_AVX512 void block_512i(const uint8_t* w, const RowArgs* rows, int64_t KB, int group_shift, const Header& hd,
                            const int32_t* qi) {
  constexpr int R = 16;
  const __m512i m0f = _mm512_set1_epi8(0x0f), z = _mm512_setzero_si512();
  alignas(64) float yacc[R][16];
  for (int r = 0; r < R; ++r) _mm512_store_ps(yacc[r], _mm512_setzero_ps());
  __m512 sc, of;
  const int64_t per_group = int64_t(1) << group_shift;
  const uint8_t* p = w;
  const uint8_t* h = w;
  for (int64_t b = 0; b < KB; ++b, p += 64 * BITS) {
    if ((b & (per_group - 1)) == 0) {
      h = p;
      if (!hd.kq) load_header16(h, hd, sc, of);
      p += hd.bytes;
    }
    if (hd.kq) load_kheader16(h, b & 7, sc, of);
    for (int l = 0; l < BITS; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * l), SGRT_PREFETCH_HINT);
    __m512i a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_si512();
#define SGRT_KPAIR16(v, pair)  /* one k-pair of the 16 weight rows (v), all 16 rows of x */ \
  for (int r = 0; r < R; ++r) a[r] = _mm512_dpwssd_epi32(a[r], v, _mm512_set1_epi32(qi[(pair) * R + r]));
    if (BITS == 8) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
      {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
        SGRT_KPAIR16(v, 16 * b + j)
      }
    } else {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(p + 64 * c);
        const __m512i lo = _mm512_unpacklo_epi8(v, z), hi = _mm512_unpackhi_epi8(v, z);
        const __m512i k0 = _mm512_and_si512(lo, m0f), k1 = _mm512_and_si512(hi, m0f);
        SGRT_KPAIR16(k0, 16 * b + 4 * c)
        SGRT_KPAIR16(k1, 16 * b + 4 * c + 1)
        const __m512i k2 = _mm512_srli_epi16(lo, 4), k3 = _mm512_srli_epi16(hi, 4);
        SGRT_KPAIR16(k2, 16 * b + 4 * c + 2)
        SGRT_KPAIR16(k3, 16 * b + 4 * c + 3)
      }
    }
#undef SGRT_KPAIR16
    for (int r = 0; r < R; ++r) {
      __m512 y = _mm512_load_ps(yacc[r]);
      y = epilogue512(a[r], sc, of, rows[r].dx[b], rows[r].qs[b], y);
      _mm512_store_ps(yacc[r], y);
    }
    asm volatile("" : : "r"(&yacc[0][0]) : "memory");
  }
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_load_ps(yacc[r]);
  store16<R>(y, rows);
}

// ---- setup, scratch and threading -----------------------------------------------------------------
// A batch-1 decode step makes ~120 calls of a few to a few hundred us each, so a call's fixed cost
// counts: nothing here allocates once its thread has served a call of that size (the scratch
// below is per thread and grows only: at most the largest call's quantized x, 2 bytes an input,
// and a tile's expanded X, <= 256 KB).

// Per-thread scratch: the quantized rows of x (q1 / q2 or Q, dx, qs) and the expanded X of a tile.
struct Scratch {
  std::vector<int8_t> q1, q2, X;
  std::vector<int16_t> Q;
  std::vector<int32_t> Qi;  // interleave16's activations of a tile
  std::vector<float> dx, qs;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {  // grown, never shrunk (not zeroed: every byte read is written first)
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// x's rows quantized (quantize_row): q1 / q2 (4-bit codes; q2 none with int8 activations) or Q
// (8-bit codes), dx, qs.
struct QuantizedX {
  int8_t* q1;
  int8_t* q2;
  int16_t* Q;
  float* dx;
  float* qs;
};

// This thread's scratch, grown to hold M quantized rows of k inputs for `bits`-bit codes.
// (q1 and q2 int8 for 4-bit codes, as vpmaddubsw takes; Q int16 for 8-bit codes, as vpmaddwd takes)
template <bool ACT8>
QuantizedX quantized_scratch(int64_t M, int64_t k, int64_t bits) {
  Scratch& s = scratch();
  const int64_t KB = k / QBLOCK;
  // (5-bit codes: q1 / q2 for one row's nibble streams, Q for the 8-bit kernels on expanded blocks)
  const bool nibbles = bits == 4 || bits == 5;
  return {at_least(s.q1, nibbles ? M * k : 0), ACT8 ? nullptr : at_least(s.q2, nibbles ? M * k : 0),
          bits != 4 || (!ACT8 && M >= 4) ? at_least(s.Q, M * k) : nullptr, at_least(s.dx, M * KB), at_least(s.qs, M * KB)};
}

// Rows m0..m1 of x quantized into q.
template <bool ACT8>
void quantize_rows(const uint16_t* xb, int64_t m0, int64_t m1, int64_t k, int64_t bits, const QuantizedX& q) {
  const int64_t KB = k / QBLOCK;
  for (int64_t m = m0; m < m1; ++m) {
    if (bits == 4 || bits == 5)
      quantize_row(xb + m * k, k, q.q1 + m * k, ACT8 ? nullptr : q.q2 + m * k, q.Q ? q.Q + m * k : nullptr,
                   q.dx + m * KB, q.qs + m * KB, ACT8);
    else
      quantize_row(xb + m * k, k, nullptr, nullptr, q.Q + m * k, q.dx + m * KB, q.qs + m * KB, ACT8);
  }
}

// y's 16-row output blocks b0..b1 for all M rows of x, from x quantized (q1, q2, Q, dx, qs: see
// QuantizedX; passed as plain pointers, see the note below): the kernel's one computation, which
// both the per-call entry (linear_raw) and the in-team entry (linear_part) run.
// ACT8: the opt-in int8 activations (linear_q8: q1 alone, dx = max|x| / 127 per block of 32).
// NOTE: the loops below keep the shape they had with per-call vectors: a variant that passed the
// quantized rows around in a struct (and quantized a small x on every thread) made GCC spill the
// kernel's accumulators, 1.25-1.35x the time of a decode step's 120 calls; measure after a change.
template <bool ACT8>
void linear_blocks5(const int8_t* q1, const int8_t* q2, const int16_t* Q, const float* dx, const float* qs, int64_t M,
                    const uint8_t* wp, int64_t n, int64_t k, int64_t format, int64_t group, uint16_t* yp, int64_t b0,
                    int64_t b1);

template <bool ACT8>
__attribute__((noinline)) void linear_blocks(const int8_t* const q1, const int8_t* const q2, const int16_t* const Q,
                                             const float* const dx, const float* const qs, int64_t M,
                                             const uint8_t* wp, int64_t n, int64_t k, int64_t format, int64_t group,
                                             uint16_t* yp, int64_t b0, int64_t b1) {
  const int64_t bits = width_of(format);  // (format: the operators' `bits` argument, see Header)
  if (bits == 5) return linear_blocks5<ACT8>(q1, q2, Q, dx, qs, M, wp, n, k, format, group, yp, b0, b1);
  const Header hd = header_of(format);
  const int64_t block_bytes = block_bytes_of(hd, bits, k, group);
  const int64_t KB = k / QBLOCK;
  const int group_shift = group_shift_of(hd, group);  // log2(blocks of 32 inputs a header)
  if (bits == 8 && M == 1 && STREAMS8 > 1) {  // decode: several streams (block8_streams)
    if (has_avx512_vnni()) return row8_streams512(wp, block_bytes, b0, b1, RowArgs{Q, dx, qs, nullptr}, yp, KB, group_shift, hd);
    row8_streams(wp, block_bytes, b0, b1, RowArgs{Q, dx, qs, nullptr}, yp, KB, group_shift, hd);
    return;
  }
  // bytes of expanded activations per row; a tile of rows keeps them within ~256 KB (L2). 8-bit
  // codes read the int16 Q in place: a tile of them within SGRT_TILE8 bytes (128 KB) stays in L2
  // beside a thread's weight blocks (all rows at once: 1,024 rows of k = 2,048 are 4 MB, read
  // from L3 for every weight block)
  const int64_t row_bytes = bits == 4 ? (ACT8 ? 8 : 16) * k : 0;
  // 4-bit codes with int16 activations from 4 rows on: rows four at a time from their int16 Q
  // (block4x4w), in tiles as the 8-bit codes' Q; the (< 4) rows left over in a tile from expand4's
  // vectors
  const bool wide4 = bits == 4 && !ACT8 && Q != nullptr && SGRT_BLOCK4W;
  const bool avx512 = has_avx512_vnni();  // the multi-row tiles as AVX-512 VNNI kernels
  const int64_t tile = bits == 4 && !wide4
                           ? std::min<int64_t>(M, std::max<int64_t>(2, (SGRT_TILE4 / row_bytes) & ~int64_t(1)))
                           : std::min<int64_t>(M, std::max<int64_t>(4, (SGRT_TILE8 / (2 * k)) & ~int64_t(3)));
  // (this thread's; not zeroed: expand4 writes every byte read)
  // 64-byte aligned: block4's 32-byte loads of X otherwise straddle cache lines every other load
  // (a vector's data is only 16-byte aligned), 1.15x the time at 256 rows
  int8_t* const Xbuf = at_least(scratch().X, (wide4 ? 3 : tile) * row_bytes + 128);
  int8_t* const X = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(Xbuf) + 63) & ~uintptr_t(63));
  for (int64_t t0 = 0; t0 < M; t0 += tile) {
    const int64_t t1 = std::min(M, t0 + tile);
    const int64_t x0 = wide4 ? t0 + ((t1 - t0) & ~int64_t(3)) : t0;  // the first row read through X
    if (bits == 4)
      for (int64_t m = x0; m < t1; ++m) expand4(q1 + m * k, ACT8 ? nullptr : q2 + m * k, k, X + (m - x0) * row_bytes);
    if (bits == 4 && M == 1 && STREAMS4 > 1) {  // decode: several streams (block4_streams)
      if (has_avx512_vnni()) return row4_streams512<ACT8>(wp, block_bytes, b0, b1, RowArgs{X, dx, qs, nullptr}, yp, KB, group_shift, hd);
      row4_streams<ACT8>(wp, block_bytes, b0, b1, RowArgs{X, dx, qs, nullptr}, yp, KB, group_shift, hd);
      return;
    }
    // AVX-512: the tile's groups of 16 rows interleaved (block_512i)
    const int64_t g16 = avx512 && (bits == 8 || wide4) ? (t1 - t0) / 16 : 0;
    int32_t* const Qi = g16 ? at_least(scratch().Qi, g16 * 8 * k) : nullptr;
    for (int64_t g = 0; g < g16; ++g) interleave16(Q + (t0 + 16 * g) * k, k, Qi + g * 8 * k);
    // the row's activations: expanded (4-bit, this tile), or the int16 q themselves (8-bit)
    auto xrow = [&](int64_t m) -> const void* {
      return bits == 4 ? static_cast<const void*>(X + (m - x0) * row_bytes) : static_cast<const void*>(Q + m * k);
    };
    // row m's arguments for block b, its activations at act
    auto args = [&](int64_t m, int64_t b, const void* act) {
      return RowArgs{act, dx + m * KB, qs + m * KB, yp + m * n + b * BLOCK_N};
    };
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* w = wp + b * block_bytes;
      int64_t m = t0;
      for (int64_t g = 0; g < g16; ++g, m += 16) {
        RowArgs rows[16];
        for (int r = 0; r < 16; ++r) rows[r] = args(m + r, b, nullptr);
        if (bits == 8) block_512i<8>(w, rows, KB, group_shift, hd, Qi + g * 8 * k);
        else block_512i<4>(w, rows, KB, group_shift, hd, Qi + g * 8 * k);
      }
      if (avx512 && (bits == 8 || wide4)) {  // the rest 8, then 4, a weight load
        const auto tiles = [&](auto rows_c) {
          constexpr int R = decltype(rows_c)::value;
          for (; m + R <= t1; m += R) {
            RowArgs rows[R];
            for (int r = 0; r < R; ++r) rows[r] = args(m + r, b, Q + (m + r) * k);
            if (bits == 8) block8_512<R>(w, rows, KB, group_shift, hd);
            else block4w_512<R>(w, rows, KB, group_shift, hd);
          }
        };
        tiles(std::integral_constant<int, 8>());
        tiles(std::integral_constant<int, 4>());
      }
      if (bits == 8)
        for (; m + 4 <= t1; m += 4) {
          const RowArgs rows[4] = {
              {xrow(m), dx + m * KB, qs + m * KB, yp + m * n + b * BLOCK_N},
              {xrow(m + 1), dx + (m + 1) * KB, qs + (m + 1) * KB, yp + (m + 1) * n + b * BLOCK_N},
              {xrow(m + 2), dx + (m + 2) * KB, qs + (m + 2) * KB, yp + (m + 2) * n + b * BLOCK_N},
              {xrow(m + 3), dx + (m + 3) * KB, qs + (m + 3) * KB, yp + (m + 3) * n + b * BLOCK_N}};
          block8x4(w, rows, KB, group_shift, hd);
        }
      if (wide4)
        for (; m + 4 <= t1; m += 4) {
          const RowArgs rows[4] = {
              {Q + m * k, dx + m * KB, qs + m * KB, yp + m * n + b * BLOCK_N},
              {Q + (m + 1) * k, dx + (m + 1) * KB, qs + (m + 1) * KB, yp + (m + 1) * n + b * BLOCK_N},
              {Q + (m + 2) * k, dx + (m + 2) * KB, qs + (m + 2) * KB, yp + (m + 2) * n + b * BLOCK_N},
              {Q + (m + 3) * k, dx + (m + 3) * KB, qs + (m + 3) * KB, yp + (m + 3) * n + b * BLOCK_N}};
          block4x4w(w, rows, KB, group_shift, hd);
        }
      for (; m + 2 <= t1; m += 2) {
        const RowArgs rows[2] = {
            {xrow(m), dx + m * KB, qs + m * KB, yp + m * n + b * BLOCK_N},
            {xrow(m + 1), dx + (m + 1) * KB, qs + (m + 1) * KB, yp + (m + 1) * n + b * BLOCK_N}};
        if (bits == 4 && !ACT8) block4x2(w, rows, KB, group_shift, hd);
        else if (bits == 4) block4<2, ACT8>(w, rows, KB, group_shift, hd);
        else block8<2>(w, rows, KB, group_shift, hd);
      }
      if (m < t1) {
        const RowArgs rows[1] = {{xrow(m), dx + m * KB, qs + m * KB, yp + m * n + b * BLOCK_N}};
        if (bits == 4) block4<1, ACT8>(w, rows, KB, group_shift, hd);
        else block8<1>(w, rows, KB, group_shift, hd);
      }
    }
  }
}

// linear_blocks for a 5-bit stream (see FIVE_BYTES): one row on AVX-512 VNNI from its 5-bit part
// (row5_streams512 on expand4's vectors of q1 / q2), anything else from its 8-bit part (Q).
template <bool ACT8>
void linear_blocks5(const int8_t* q1, const int8_t* q2, const int16_t* Q, const float* dx, const float* qs, int64_t M,
                    const uint8_t* wp, int64_t n, int64_t k, int64_t format, int64_t group, uint16_t* yp, int64_t b0,
                    int64_t b1) {
  const Header hd = header_of(format);
  const int64_t G = k / group, KB = k / QBLOCK;
  const int64_t bytes5 = G * hd.bytes + KB * FIVE_BYTES;
  if (M == 1 && has_avx512_vnni()) {
    const int group_shift = group == 32 ? 0 : group == 64 ? 1 : 2;
    int8_t* const Xbuf = at_least(scratch().X, (ACT8 ? 8 : 16) * k + 128);
    int8_t* const X = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(Xbuf) + 63) & ~uintptr_t(63));
    expand4(q1, ACT8 ? nullptr : q2, k, X);
    row5_streams512<ACT8>(wp, bytes5, b0, b1, RowArgs{X, dx, qs, nullptr}, yp, KB, group_shift, hd);
    return;
  }
  linear_blocks<ACT8>(q1, q2, Q, dx, qs, M, wp + n / BLOCK_N * bytes5, n, k, 8 + (format & ~int64_t(255)), group, yp,
                      b0, b1);
}

// y [M, n] (bf16 bits) = x [M, k] (bf16 bits) @ the fused weight stream wp, arguments valid
// (woq_linear checks them). The computation behind sgrt_woq_avx2.linear (ACT8: linear_q8),
// without a tensor in sight: x quantized once (rows split across threads), then the output blocks
// split across threads (at::parallel_for, one OpenMP region each). The decode plan
// (sgrt/kernels/layer_ops_cpu/decode_plan.cpp) calls it directly outside its thread team (raw calls below).
// yf: where given, y widened to float32 as well (exactly: y.float()'s values), each thread its own
// output blocks right after computing them, while they are in its cache (the LM head's logits:
// a second parallel pass over them cost ~100 us a step for SmolLM2's 49k, ~200 for Gemma 3's 262k).
template <bool ACT8>
void linear_into(const uint16_t* xb, int64_t M, const uint8_t* wp, int64_t n, int64_t k, int64_t bits, int64_t group,
                 uint16_t* yp, float* yf) {
  if (M == 0) return;
  // (the calling thread's, shared with the team)
  const QuantizedX q = quantized_scratch<ACT8>(M, k, width_of(bits));
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / k),
                   [&](int64_t m0, int64_t m1) { quantize_rows<ACT8>(xb, m0, m1, k, width_of(bits), q); });
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    linear_blocks<ACT8>(q.q1, q.q2, q.Q, q.dx, q.qs, M, wp, n, k, bits, group, yp, b0, b1);
    if (yf == nullptr) return;
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* src = yp + m * n + b0 * BLOCK_N;
      float* dst = yf + m * n + b0 * BLOCK_N;
#pragma omp simd
      for (int64_t j = 0; j < (b1 - b0) * BLOCK_N; ++j) dst[j] = sgrt::bf16::to_float(src[j]);
    }
  });
}

template <bool ACT8>
void linear_raw(const uint16_t* xb, int64_t M, const uint8_t* wp, int64_t n, int64_t k, int64_t bits, int64_t group,
                uint16_t* yp) {
  linear_into<ACT8>(xb, M, wp, n, k, bits, group, yp, nullptr);
}

// linear_raw's part `part` of `parts` (0 <= part < parts), for a thread of a team that the caller
// already runs (the decode plan's one OpenMP region a step): this thread quantizes all of x into
// its own scratch (a decode-sized x: cheaper than a barrier), then computes the output blocks
// [nb * part / parts, nb * (part + 1) / parts) of the nb = n / 16. Opens no parallel region and
// waits for no other thread; the parts of one y together write each output once, with the same
// bits as linear_raw (a row's outputs do not depend on the split).
template <bool ACT8>
void linear_part(const uint16_t* xb, int64_t M, const uint8_t* wp, int64_t n, int64_t k, int64_t bits, int64_t group,
                 uint16_t* yp, int64_t part, int64_t parts) {
  const int64_t nb = n / BLOCK_N, b0 = nb * part / parts, b1 = nb * (part + 1) / parts;
  if (M == 0 || b0 == b1) return;
  const QuantizedX q = quantized_scratch<ACT8>(M, k, width_of(bits));
  quantize_rows<ACT8>(xb, 0, M, k, width_of(bits), q);
  linear_blocks<ACT8>(q.q1, q.q2, q.Q, q.dx, q.qs, M, wp, n, k, bits, group, yp, b0, b1);
}

// linear_q8_prefill: int8 activations for a call of at least Q8_PREFILL_ROWS rows (prefill / extend
// chunks, large batches: the kernel is compute-bound there and int8 halves its vpmaddubsw), the
// default 16-bit ones below (decode: memory-bound, where int8 gains nothing and costs accuracy).
constexpr int64_t Q8_PREFILL_ROWS = 32;

void linear_raw_q8_prefill(const uint16_t* xb, int64_t M, const uint8_t* wp, int64_t n, int64_t k, int64_t bits,
                           int64_t group, uint16_t* yp) {
  if (M >= Q8_PREFILL_ROWS) linear_raw<true>(xb, M, wp, n, k, bits, group, yp);
  else linear_raw<false>(xb, M, wp, n, k, bits, group, yp);
}

void linear_part_q8_prefill(const uint16_t* xb, int64_t M, const uint8_t* wp, int64_t n, int64_t k, int64_t bits,
                            int64_t group, uint16_t* yp, int64_t part, int64_t parts) {
  if (M >= Q8_PREFILL_ROWS) linear_part<true>(xb, M, wp, n, k, bits, group, yp, part, parts);
  else linear_part<false>(xb, M, wp, n, k, bits, group, yp, part, parts);
}

// The checks of sgrt_woq_avx2.linear on its arguments (the decode plan runs them once per weight,
// with an x of no rows, before it calls linear_raw directly).
void check_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
                int64_t n, int64_t k, int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8 || (bits > 256 && bits < 65536 && (width_of(bits) == 8 || width_of(bits) == 5))
                  || bits == 4 + KQ_FLAG,
              "sgrt_woq_avx2.linear: bits must be 4, 5 or 8, 8 / 5 + 256 * c with c in 1..255 (8-bit or 5-bit "
              "codes, offsets -c * scale, compact group headers), or 4 + 65536 (K-quant super-blocks), got ", bits);
  TORCH_CHECK(!(bits & KQ_FLAG) || (group == 32 && k % 256 == 0),
              "sgrt_woq_avx2.linear: a K-quant stream (bits 4 + 65536) needs group=32 and k a multiple of 256, got "
              "group=", group, ", k=", k);
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
  const int64_t G = k / group;
  for (const auto* t : {&scales, &offsets}) {
    const char* name = t == &scales ? "scales" : "offsets";
    TORCH_CHECK(t->scalar_type() == at::kHalf, "sgrt_woq_avx2.linear: ", name, " must be float16, got ",
                t->scalar_type());
    if (t->numel() == 0) continue;  // (not read: packed holds them; GroupLinear passes empty ones)
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == G, "sgrt_woq_avx2.linear: ", name,
                " must be [n=", n, ", k/group=", G, "] (or empty), got ", t->sizes());
    TORCH_CHECK(t->is_contiguous(), "sgrt_woq_avx2.linear: ", name, " must be contiguous");
  }
  // per block of 16 rows and group: a 64-byte header (scales, offsets; compact: 32, scales), then
  // the group's codes
  const Header hd = header_of(bits);
  int64_t block_bytes = block_bytes_of(hd, width_of(bits), k, group);
  if (width_of(bits) == 5) block_bytes += G * (hd.bytes + BLOCK_N * group);  // (then the 8-bit stream)
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == n / BLOCK_N * block_bytes,
              "sgrt_woq_avx2.linear: packed must be contiguous with n*k*bits/8 + ",
              hd.kq ? "20*n*k/256" : std::to_string(hd.bytes / 16) + "*n*k/group",
              width_of(bits) == 5 ? " (twice: 5 bits, then 8)" : "", "=", n / BLOCK_N * block_bytes,
              " bytes (woq.fuse / fuse5: codes, scales", hd.negc == 0.0f ? " and offsets" : "", " in one stream), got ",
              packed.numel());
}

// dequantize_rows: rows [r0, r1) of the weight (16-row blocks) as bfloat16, each value
// scale * code + offset in float32 (two roundings: -ffp-contract=off), then rounded to nearest
// even: woq.dequantize(..., bfloat16)'s bits, read straight from the stream (a 5-bit stream's 8-bit
// part). For a dense matmul of many rows where the CPU's bfloat16 matmul is faster than this
// kernel (AMX: GroupLinear's prefill path), a tile of rows at a time.
at::Tensor woq_dequantize_rows(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets, int64_t n,
                               int64_t k, int64_t bits, int64_t group, int64_t r0, int64_t r1) {
  check_args(at::detail::empty_cpu({0, k}, at::kBFloat16), packed, scales, offsets, n, k, bits, group);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= n && r0 % BLOCK_N == 0 && r1 % BLOCK_N == 0,
              "sgrt_woq_avx2.dequantize_rows: rows [r0, r1) must be 16-row blocks within n=", n, ", got [", r0, ", ", r1, ")");
  const Header hd = header_of(bits);
  const int64_t width = width_of(bits) == 5 ? 8 : width_of(bits);
  const int64_t G = k / group, code_bytes = BLOCK_N * group * width / 8;
  const int64_t block_bytes = block_bytes_of(hd, width, k, group);
  const uint8_t* base = packed.data_ptr<uint8_t>();
  if (width_of(bits) == 5) base += n / BLOCK_N * (G * hd.bytes + BLOCK_N * k * 5 / 8);  // (the 8-bit stream)
  at::Tensor w(at::detail::empty_cpu({r1 - r0, k}, at::kBFloat16));
  uint16_t* out = reinterpret_cast<uint16_t*>(w.data_ptr());
  at::parallel_for(r0 / BLOCK_N, r1 / BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float tile[BLOCK_N * 128];  // one group's codes, row-major
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = base + b * block_bytes;
      for (int64_t g = 0; g < G; ++g) {
        // (K-quant: the super-block's header, then its 8 groups' codes)
        const uint8_t* h = hd.kq ? blk + (g >> 3) * (hd.bytes + 8 * code_bytes) : blk + g * (hd.bytes + code_bytes);
        const uint8_t* c = h + hd.bytes + (hd.kq ? (g & 7) * code_bytes : 0);
        alignas(32) float sc[BLOCK_N], of[BLOCK_N];
        __m256 so[4];
        if (hd.kq) load_kheader(h, g & 7, so);
        else load_header(h, so, hd);
        _mm256_store_ps(sc, so[0]);
        _mm256_store_ps(sc + 8, so[1]);
        _mm256_store_ps(of, so[2]);
        _mm256_store_ps(of + 8, so[3]);
        if (width == 8) {  // k-pair p: 32 bytes, byte j = (row j / 2, input 2 p + j % 2)
          for (int64_t p = 0; p < group / 2; ++p)
            for (int j = 0; j < 32; ++j) tile[(j >> 1) * group + 2 * p + (j & 1)] = c[p * 32 + j];
        } else {  // 64-byte chunks of 4 k-pairs: byte 16 L + 8 s + i holds word 8 L + i of vectors s, 2 + s
          for (int64_t ch = 0; ch < group / 8; ++ch)
            for (int L = 0; L < 4; ++L)
              for (int sv = 0; sv < 2; ++sv)
                for (int i = 0; i < 8; ++i) {
                  const uint8_t byte = c[ch * 64 + 16 * L + 8 * sv + i];
                  const int64_t row = 4 * L + (i >> 1), odd = i & 1;
                  tile[row * group + 2 * (4 * ch + sv) + odd] = byte & 15;
                  tile[row * group + 2 * (4 * ch + 2 + sv) + odd] = byte >> 4;
                }
        }
        for (int64_t r = 0; r < BLOCK_N; ++r) {
          uint16_t* dst = out + ((b * BLOCK_N + r) - r0) * k + g * group;
          const float* src = tile + r * group;
          const float a = sc[r], o = of[r];
          for (int64_t j = 0; j < group; j += 8) {
            const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(src + j), _mm256_set1_ps(a)), _mm256_set1_ps(o));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), from_float8(v));
          }
        }
      }
    }
  });
  return w;
}

// The operators linear, linear_q8, linear_q8_prefill: check_args, then the raw computation F.
template <sgrt::WoqRaw* F>
at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t n, int64_t k, int64_t bits, int64_t group) {
  check_args(x, packed, scales, offsets, n, k, bits, group);
  const int64_t M = x.size(0);
  at::Tensor y(at::detail::empty_cpu({M, n}, at::kBFloat16));
  F(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, packed.data_ptr<uint8_t>(), n, k, bits, group,
             reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}

// linear_float: linear's output widened to float32 (linear(...).float(), in one pass: linear_into).
at::Tensor woq_linear_float(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& offsets, int64_t n, int64_t k, int64_t bits, int64_t group) {
  check_args(x, packed, scales, offsets, n, k, bits, group);
  const int64_t M = x.size(0);
  at::Tensor y(at::detail::empty_cpu({M, n}, at::kBFloat16));
  at::Tensor yf(at::detail::empty_cpu({M, n}, at::kFloat));
  linear_into<false>(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, packed.data_ptr<uint8_t>(), n, k, bits, group,
                     reinterpret_cast<uint16_t*>(y.data_ptr()), yf.data_ptr<float>());
  return yf;
}

// The raw-block operators' argument check: blocks contiguous uint8 [n, k / per * bytes] (ggml's
// blocks of `per` weights, `bytes` each), k a multiple of per, n of 16 where whole 16-row blocks
// are written (the streams).
void check_blocks(const char* op, const at::Tensor& blocks, int64_t n, int64_t k, int64_t per, int64_t bytes,
                  bool row_blocks) {
  TORCH_CHECK(n > 0 && (!row_blocks || n % BLOCK_N == 0) && k > 0 && k % per == 0 && blocks.dtype() == at::kByte &&
                  blocks.is_contiguous() && blocks.numel() == n * (k / per) * bytes,
              "sgrt_woq_avx2.", op, ": blocks must be contiguous uint8 [n, k / ", per, " * ", bytes, "] with ",
              row_blocks ? "n a multiple of 16 and " : "", "k a multiple of ", per, ", got ", blocks.numel(),
              " bytes for n=", n, ", k=", k);
}

// A 4-bit chunk byte holds the codes of inputs x and x + 4 (pack()'s layout). Where a GGUF block
// keeps input x's code in the low (high) nibble of byte x, the chunk bytes of inputs x .. x + 3
// are one mask and shift of the 32-bit words at bytes x and x + 4.
inline uint32_t nibble_pairs(uint32_t x, uint32_t x4, bool high) {
  constexpr uint32_t kLow = 0x0F0F0F0Fu;
  return high ? ((x >> 4) & kLow) | (x4 & ~kLow) : (x & kLow) | ((x4 & kLow) << 4);
}

// Row r's four chunk bytes v (inputs 8 c + 0..3 of a chunk c) into that chunk's 32 words: byte
// (L, s, i) of the chunk is the code pair of row 4 L + i / 2, so the low half of v goes to word
// 8 L + h and the high half to word 8 L + 4 + h (L = r / 4, h = r % 4).
inline void put_chunk_row(uint16_t* chunk, int r, uint32_t v) {
  chunk[8 * (r / 4) + r % 4] = static_cast<uint16_t>(v);
  chunk[8 * (r / 4) + 4 + r % 4] = static_cast<uint16_t>(v >> 16);
}

// A K-quant super-block's 6-bit scales and mins from its 12 bytes q (ggml's get_scale_min_k4).
inline void k_scales(const uint8_t* q, uint8_t (&sc)[8], uint8_t (&mn)[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = static_cast<uint8_t>((q[j + 8] & 0x0F) | ((q[j] >> 6) << 4));
    mn[j + 4] = static_cast<uint8_t>((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
  }
}

// fuse_q4_1: GGUF Q4_1 blocks [n, k / 32 * 20] (block_q4_1: float16 d, m, 16 bytes of nibbles)
// -> this kernel's stream of 4-bit codes, exactly woq.fuse(woq.pack(codes, 4), d, m) (woq.fuse_q4_1
// documents the layout and is the reference): per 16-row block and group, the rows' d and m, then
// 4 chunks whose byte (L, s, i) holds the codes of inputs x and x + 4 (x = 8 chunk + 2 s + i % 2)
// of row 4 L + i / 2. Both are low nibbles of the block's bytes x and x + 4 (chunks 0, 1) or both
// high ones (chunks 2, 3), so each row's 16 chunk bytes are four 32-bit masks and shifts of its
// nibble bytes, stored as 16-bit words in place. One thread (the packer runs chunks in parallel).
at::Tensor woq_fuse_q4_1(const at::Tensor& blocks, int64_t n, int64_t k) {
  check_blocks("fuse_q4_1", blocks, n, k, 32, 20, true);
  const int64_t nb = n / BLOCK_N, G = k / 32;
  at::Tensor out(at::detail::empty_cpu({nb * G * 320}, at::kByte));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<uint8_t>());
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      uint16_t* o = dst + (b * G + g) * 160;  // 32 header words, then 4 chunks of 32 words
      for (int r = 0; r < BLOCK_N; ++r) {
        const uint8_t* blk = src + ((b * BLOCK_N + r) * G + g) * 20;
        uint16_t dm[2];
        uint32_t w[4];
        std::memcpy(dm, blk, 4);
        std::memcpy(w, blk + 4, 16);
        o[r] = dm[0];
        o[BLOCK_N + r] = dm[1];
        for (int c = 0; c < 4; ++c)  // chunks 0, 1: low nibbles of bytes 0-7, 8-15; chunks 2, 3: high ones
          put_chunk_row(o + 32 + 32 * c, r, nibble_pairs(w[2 * (c % 2)], w[2 * (c % 2) + 1], c >= 2));
      }
    }
  }
  return out;
}

// fuse_q4_k: GGUF Q4_K super-blocks [n, k / 256 * 144] (block_q4_K: float16 d, dmin, 12 bytes of
// 6-bit scales and mins, 128 bytes of nibbles) -> the K-quant stream, exactly woq.fuse_kq4 of
// gguf_raw.unpack_q4_k_super's fields (the reference; woq.fuse_q4_k documents it): per 16-row
// block and super-block a 320-byte header (the rows' d, their dmin, sc[j][row], mn[j][row]) and
// the 8 groups' codes in pack()'s 4-bit layout. Group j's codes are the low (j even) or high
// nibbles of the super-block's bytes 32 (j / 2) .. + 31, so, as in fuse_q4_1, a chunk byte's two
// codes (inputs x and x + 4) are the same nibble of bytes x and x + 4: each row's 4 chunk bytes
// of a group's chunk are one 32-bit mask and shift of two words. One thread.
at::Tensor woq_fuse_q4_k(const at::Tensor& blocks, int64_t n, int64_t k) {
  check_blocks("fuse_q4_k", blocks, n, k, 256, 144, true);
  const int64_t nb = n / BLOCK_N, S = k / 256;
  constexpr int64_t kHead = 320, kSuper = kHead + 8 * 256;
  at::Tensor out(at::detail::empty_cpu({nb * S * kSuper}, at::kByte));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      uint8_t* o = dst + (b * S + s) * kSuper;
      for (int r = 0; r < BLOCK_N; ++r) {
        const uint8_t* blk = src + ((b * BLOCK_N + r) * S + s) * 144;
        std::memcpy(o + 2 * r, blk, 2);            // d
        std::memcpy(o + 32 + 2 * r, blk + 2, 2);   // dmin
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        for (int j = 0; j < 8; ++j) {
          o[64 + 16 * j + r] = sc[j];
          o[192 + 16 * j + r] = mn[j];
        }
        for (int c = 0; c < 4; ++c) {  // nibble bytes 32 c .. 32 c + 31: groups 2 c (low), 2 c + 1 (high)
          uint32_t w[8];
          std::memcpy(w, blk + 16 + 32 * c, 32);
          for (int j = 2 * c; j < 2 * c + 2; ++j) {
            uint16_t* group = reinterpret_cast<uint16_t*>(o + kHead + 256 * j);
            for (int cc = 0; cc < 4; ++cc)  // chunk cc: inputs 8 cc .. 8 cc + 7, words w[2 cc], w[2 cc + 1]
              put_chunk_row(group + 32 * cc, r, nibble_pairs(w[2 * cc], w[2 * cc + 1], j % 2));
          }
        }
      }
    }
  }
  return out;
}

// The frame of a dequantize op over GGUF super-blocks of 256 weights in `bytes` bytes
// ([n, k / 256 * bytes] uint8, check_blocks' checks): an empty float32 [n, k], and
// super(block, out) for each super-block and its 256 outputs, in order. One thread.
template <typename Super>
at::Tensor dequantize_supers(const char* op, const at::Tensor& blocks, int64_t n, int64_t k, int64_t bytes,
                             Super super) {
  check_blocks(op, blocks, n, k, 256, bytes, false);
  at::Tensor out(at::detail::empty_cpu({n, k}, at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t sb = 0; sb < n * (k / 256); ++sb) super(src + sb * bytes, dst + sb * 256);
  return out;
}

// dequantize_q6_k: GGUF Q6_K super-blocks [n, k / 256 * 210] (block_q6_K: 128 bytes of low
// nibbles ql, 64 bytes of high bit pairs qh, 16 int8 scales, float16 d) -> float32 [n, k], the
// values gguf's numpy dequantization gives (gguf_raw.dequantize documents it; gguf is the
// reference): weight e of a super-block, in half h = e / 128 at r = e % 128, has the code
// q = ((ql[64 h + r % 64] >> 4 (r / 64)) & 15 | ((qh[32 h + r % 32] >> 2 (r / 32)) & 3) << 4) - 32
// and the value (float(d) * float(scale[e / 16])) * float(q), two float32 roundings. One thread.
at::Tensor woq_dequantize_q6_k(const at::Tensor& blocks, int64_t n, int64_t k) {
  return dequantize_supers("dequantize_q6_k", blocks, n, k, 210, [](const uint8_t* b, float* o) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scale = reinterpret_cast<const int8_t*>(b + 192);
    uint16_t dh;
    std::memcpy(&dh, b + 208, 2);
    const float d = _cvtsh_ss(dh);
    const __m256i nib = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      for (int t = 0; t < 4; ++t) {  // weights 128 h + 32 t + j: ql byte 64 h + 32 (t % 2) + j, qh byte 32 h + j
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (t % 2)));
        const __m256i l4 = _mm256_and_si256(t < 2 ? lo : _mm256_srli_epi16(lo, 4), nib);
        const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * t)), two);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)), bias);  // -32..31
        const int e0 = 128 * h + 32 * t;
        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
        const __m128i part[4] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
        for (int v = 0; v < 4; ++v) {  // 8 weights a vector; their scale group (e0 + 8 v) / 16
          const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[v]));
          const float step = d * static_cast<float>(scale[(e0 + 8 * v) / 16]);
          _mm256_storeu_ps(o + e0 + 8 * v, _mm256_mul_ps(_mm256_set1_ps(step), qf));
        }
      }
    }
  });
}

// dequantize_q4_k: GGUF Q4_K super-blocks [n, k / 256 * 144] -> float32 [n, k], the values
// gguf's numpy dequantization gives (gguf_raw.dequantize; gguf is the reference): group j
// of 32 has the codes q = the low (j even) or high nibbles of bytes 32 (j / 2) .. + 31 of the
// nibbles, and the values (float(d) * sc[j]) * q - float(dmin) * mn[j], each product and the
// difference one float32 rounding (sc, mn: k_scales). One thread.
at::Tensor woq_dequantize_q4_k(const at::Tensor& blocks, int64_t n, int64_t k) {
  return dequantize_supers("dequantize_q4_k", blocks, n, k, 144, [](const uint8_t* b, float* o) {
    const __m256i nib = _mm256_set1_epi8(15);
    uint16_t dh[2];
    std::memcpy(dh, b, 4);
    const float d = _cvtsh_ss(dh[0]), dmin = _cvtsh_ss(dh[1]);
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      for (int half = 0; half < 2; ++half) {  // group 2 c + half: low, then high nibbles
        const int j = 2 * c + half;
        const __m256i codes = _mm256_and_si256(half ? _mm256_srli_epi16(raw, 4) : raw, nib);
        const __m256 step = _mm256_set1_ps(d * static_cast<float>(sc[j]));
        const __m256 off = _mm256_set1_ps(dmin * static_cast<float>(mn[j]));
        const __m128i c0 = _mm256_castsi256_si128(codes), c1 = _mm256_extracti128_si256(codes, 1);
        const __m128i part[4] = {c0, _mm_srli_si128(c0, 8), c1, _mm_srli_si128(c1, 8)};
        for (int v = 0; v < 4; ++v) {
          const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[v]));
          _mm256_storeu_ps(o + 32 * j + 8 * v, _mm256_sub_ps(_mm256_mul_ps(step, qf), off));
        }
      }
    }
  });
}

// quantize_fuse: float rows w [n, k] (float32 or bfloat16, contiguous) -> the stream of their
// group-wise codes, exactly woq.fuse(woq.pack(codes, bits), scale, offset) of quant_native.
// quantize_groups(w, bits, 32)'s (codes, scale, offset) (woq.quantize_fuse documents it; that
// chain is the reference), in one pass and one thread (the packer runs chunks in parallel). Per
// row and group of 32: lo = min, hi = max (float32), scale = half((hi - lo) / levels), offset =
// half(lo), code = clamp(round_half_even((w - float(offset)) / step), 0, levels) with step =
// float(scale), 1 where scale is 0: the same float32 operations as the torch ops, one rounding
// each (a division, not a reciprocal's product). An empty tensor where a group holds a NaN or
// its scale or offset is not finite in float16 (the caller keeps that weight in float).
template <typename Load>
bool quantize_group_rows(Load load, int64_t k, int64_t g, int bits, uint16_t* head, uint8_t (&codes)[BLOCK_N][32]) {
  const float levels = static_cast<float>((1 << bits) - 1);
  for (int r = 0; r < BLOCK_N; ++r) {
    __m256 x[4];
    for (int v = 0; v < 4; ++v) x[v] = load(r, g * 32 + 8 * v);
    const __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(x[0], x[0], _CMP_UNORD_Q), _mm256_cmp_ps(x[1], x[1], _CMP_UNORD_Q)),
                                    _mm256_or_ps(_mm256_cmp_ps(x[2], x[2], _CMP_UNORD_Q), _mm256_cmp_ps(x[3], x[3], _CMP_UNORD_Q)));
    if (_mm256_movemask_ps(nan)) return false;
    __m256 mn = _mm256_min_ps(_mm256_min_ps(x[0], x[1]), _mm256_min_ps(x[2], x[3]));
    __m256 mx = _mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3]));
    __m128 m4 = _mm_min_ps(_mm256_castps256_ps128(mn), _mm256_extractf128_ps(mn, 1));
    __m128 x4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_min_ps(m4, _mm_movehl_ps(m4, m4));
    x4 = _mm_max_ps(x4, _mm_movehl_ps(x4, x4));
    const float lo = _mm_cvtss_f32(_mm_min_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float hi = _mm_cvtss_f32(_mm_max_ss(x4, _mm_shuffle_ps(x4, x4, 1)));
    const float range = hi - lo;
    const uint16_t sh = _cvtss_sh(range / levels, _MM_FROUND_TO_NEAREST_INT);
    const uint16_t oh = _cvtss_sh(lo, _MM_FROUND_TO_NEAREST_INT);
    if ((sh & 0x7C00) == 0x7C00 || (oh & 0x7C00) == 0x7C00) return false;
    head[r] = sh;
    head[BLOCK_N + r] = oh;
    const __m256 step = _mm256_set1_ps((sh & 0x7FFF) == 0 ? 1.0f : _cvtsh_ss(sh));
    const __m256 off = _mm256_set1_ps(_cvtsh_ss(oh));
    const __m256 top = _mm256_set1_ps(levels), zero = _mm256_setzero_ps();
    __m256i q[4];
    for (int v = 0; v < 4; ++v) {
      __m256 t = _mm256_div_ps(_mm256_sub_ps(x[v], off), step);
      t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[v] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(t, zero), top));
    }
    // 32 int32 codes (0..255) -> 32 bytes in order (the packs work per 128-bit lane: permute back)
    const __m256i b8 = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes[r]),
                        _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  return true;
}

at::Tensor woq_quantize_fuse(const at::Tensor& w, int64_t n, int64_t k, int64_t bits) {
  TORCH_CHECK(n > 0 && n % BLOCK_N == 0 && k > 0 && k % 32 == 0 && (bits == 4 || bits == 8) && w.is_contiguous() &&
                  (w.dtype() == at::kFloat || w.dtype() == at::kBFloat16) && w.numel() == n * k,
              "sgrt_woq_avx2.quantize_fuse: w must be contiguous float32 or bfloat16 [n, k] with n a multiple of 16, k of 32, "
              "bits 4 or 8; got ", w.dtype(), " with ", w.numel(), " elements for n=", n, ", k=", k, ", bits=", bits);
  const int64_t nb = n / BLOCK_N, G = k / 32, group_bytes = 64 + BLOCK_N * 32 * bits / 8;
  at::Tensor out(at::detail::empty_cpu({nb * G * group_bytes}, at::kByte));
  uint8_t* dst = out.data_ptr<uint8_t>();
  const bool bf16 = w.dtype() == at::kBFloat16;
  const float* wf = bf16 ? nullptr : w.data_ptr<float>();
  const uint16_t* wb = bf16 ? reinterpret_cast<const uint16_t*>(w.data_ptr()) : nullptr;
  uint8_t codes[BLOCK_N][32];
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* o = dst + (b * G + g) * group_bytes;
      uint16_t* head = reinterpret_cast<uint16_t*>(o);
      const int64_t row0 = b * BLOCK_N;
      bool ok;
      if (bf16) {
        ok = quantize_group_rows([&](int r, int64_t c) {  // bfloat16 -> float32: the upper half (exact)
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + (row0 + r) * k + c));
          return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }, k, g, static_cast<int>(bits), head, codes);
      } else {
        ok = quantize_group_rows([&](int r, int64_t c) { return _mm256_loadu_ps(wf + (row0 + r) * k + c); },
                                 k, g, static_cast<int>(bits), head, codes);
      }
      if (!ok) return at::detail::empty_cpu({0}, at::kByte);
      if (bits == 8) {  // k-pair p's vector: word row = the row's k-pair p (a pair moves as one 16-bit word)
        uint16_t pairs[BLOCK_N][16], words[BLOCK_N * 16];
        std::memcpy(pairs, codes, sizeof(pairs));
        for (int p = 0; p < 16; ++p)
          for (int row = 0; row < BLOCK_N; ++row) words[16 * p + row] = pairs[row][p];
        std::memcpy(o + 64, words, sizeof(words));
      } else {
        // Chunk c's byte 16 L + 8 s + 2 h + t: inputs x = 8 c + 2 s + t and x + 4 of row 4 L + h.
        // Per row, dword c of v = its dword 2 c | dword 2 c + 1 << 4 (bytes: inputs 8 c + i and
        // 8 c + 4 + i; codes <= 15, so no carry between bytes); a 4 x 4 transpose of rows 4 L ..
        // 4 L + 3 gives chunk c's lane L as one vector, whose low words (s = 0) and high words
        // (s = 1) one vpshufb sorts.
        __m128i v[BLOCK_N];
        const __m256i evens_odds = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        for (int r = 0; r < BLOCK_N; ++r) {
          const __m256i e = _mm256_permutevar8x32_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[r])), evens_odds);
          v[r] = _mm_or_si128(_mm256_castsi256_si128(e), _mm_slli_epi32(_mm256_extracti128_si256(e, 1), 4));
        }
        const __m128i words = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        uint8_t* c4 = o + 64;
        for (int L = 0; L < 4; ++L) {
          const __m128i* a = v + 4 * L;
          const __m128i t0 = _mm_unpacklo_epi32(a[0], a[1]), t1 = _mm_unpacklo_epi32(a[2], a[3]);
          const __m128i t2 = _mm_unpackhi_epi32(a[0], a[1]), t3 = _mm_unpackhi_epi32(a[2], a[3]);
          const __m128i col[4] = {_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1),
                                  _mm_unpacklo_epi64(t2, t3), _mm_unpackhi_epi64(t2, t3)};
          for (int c = 0; c < 4; ++c)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(c4 + 64 * c + 16 * L), _mm_shuffle_epi8(col[c], words));
        }
      }
    }
  }
  return out;
}

// Each operator's raw calls (sgrt/raw_calls.h: its per-call computation and its in-team one),
// for the decode plan's direct calls (no dispatcher, no tensors a call); `<op>_raw_calls() -> int`
// gives their address (DecodePlan::set_projection looks them up so). A function whose signature
// differs from sgrt::WoqRaw / WoqPart does not compile here.
constexpr sgrt::RawCalls kLinearCalls = sgrt::woq_raw_calls(&linear_raw<false>, &linear_part<false>);
constexpr sgrt::RawCalls kLinearQ8Calls = sgrt::woq_raw_calls(&linear_raw<true>, &linear_part<true>);
constexpr sgrt::RawCalls kLinearQ8PrefillCalls = sgrt::woq_raw_calls(&linear_raw_q8_prefill, &linear_part_q8_prefill);

template <const sgrt::RawCalls& C>
int64_t raw_calls_of() { return sgrt::raw_calls_address(C); }

}  // namespace

TORCH_LIBRARY(sgrt_woq_avx2, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, int group) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(woq_linear<&linear_raw<false>>));
  // linear's output as float32 (the LM head: logits for the sampler without a second pass)
  m.def("linear_float(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, int group) -> Tensor");
  m.impl("linear_float", c10::DispatchKey::CPU, TORCH_FN(woq_linear_float));
  // the same with int8 activations (opt-in: half the int4 kernel's vpmaddubsw, less accurate;
  // docs/DESIGN.md), always or for calls of >= Q8_PREFILL_ROWS rows only
  m.def("linear_q8(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, int group) -> Tensor");
  m.impl("linear_q8", c10::DispatchKey::CPU, TORCH_FN(woq_linear<&linear_raw<true>>));
  m.def("linear_q8_prefill(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, int group) -> Tensor");
  m.impl("linear_q8_prefill", c10::DispatchKey::CPU, TORCH_FN(woq_linear<&linear_raw_q8_prefill>));
  // rows of the weight as bfloat16 (a dense matmul's operand: GroupLinear's prefill where AMX runs it)
  m.def("dequantize_rows(Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, int group, int r0, int r1) -> Tensor");
  m.impl("dequantize_rows", c10::DispatchKey::CPU, TORCH_FN(woq_dequantize_rows));
  // GGUF Q4_1 blocks -> the int4 stream (the packer's; woq.fuse_q4_1)
  m.def("fuse_q4_1(Tensor blocks, int n, int k) -> Tensor");
  m.impl("fuse_q4_1", c10::DispatchKey::CPU, TORCH_FN(woq_fuse_q4_1));
  // GGUF Q4_K super-blocks -> the K-quant stream (the packer's; woq.fuse_q4_k)
  m.def("fuse_q4_k(Tensor blocks, int n, int k) -> Tensor");
  m.impl("fuse_q4_k", c10::DispatchKey::CPU, TORCH_FN(woq_fuse_q4_k));
  // GGUF Q6_K super-blocks -> float32 rows, gguf's values (the packer's; gguf_raw.dequantize)
  m.def("dequantize_q6_k(Tensor blocks, int n, int k) -> Tensor");
  m.impl("dequantize_q6_k", c10::DispatchKey::CPU, TORCH_FN(woq_dequantize_q6_k));
  // GGUF Q4_K super-blocks -> float32 rows, gguf's values (the packer's; gguf_raw.dequantize)
  m.def("dequantize_q4_k(Tensor blocks, int n, int k) -> Tensor");
  m.impl("dequantize_q4_k", c10::DispatchKey::CPU, TORCH_FN(woq_dequantize_q4_k));
  // float rows -> their group-wise codes' stream (the packer's; woq.quantize_fuse)
  m.def("quantize_fuse(Tensor w, int n, int k, int bits) -> Tensor");
  m.impl("quantize_fuse", c10::DispatchKey::CPU, TORCH_FN(woq_quantize_fuse));
  // (no tensor arguments: registered as catch-all kernels)
  m.def("linear_raw_calls() -> int", &raw_calls_of<kLinearCalls>);
  m.def("linear_q8_raw_calls() -> int", &raw_calls_of<kLinearQ8Calls>);
  m.def("linear_q8_prefill_raw_calls() -> int", &raw_calls_of<kLinearQ8PrefillCalls>);
}
