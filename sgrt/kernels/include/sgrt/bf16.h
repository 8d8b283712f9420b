// bfloat16 <-> float32 on raw bits, for sgrt's native libraries (sgrt/kernels/layer_ops/,
// dense_avx2.cpp, woq_avx2.cpp). The kernels keep bfloat16 values as their uint16_t bits, not as
// c10::BFloat16: a struct type keeps GCC from vectorizing the loops over them.
//
// A bfloat16 is the upper half of a float32, so widening is exact (a shift). Narrowing rounds to
// nearest even (round_bits). What a NaN becomes differs by library, and each keeps what it had
// before this header, so that no output changed by a bit:
// - from_float: NaN -> 0x7FC0, what c10::BFloat16's conversion gives, because the layer operators
//   reproduce eager PyTorch ops bit for bit;
// - from_float_keep_nan: a NaN keeps its sign and its payload's top bits, quieted (the dense
//   kernel's outputs);
// - from_float8 (AVX2, 8 lanes: the weight-only kernel's outputs): round_bits lane by lane with
//   no NaN test, the cheapest in its inner loops. A NaN stays a NaN unless its bits 15-22 are
//   all set: the rounding's carry then runs through the exponent and gives a zero (0x7FFF8000 ->
//   0x8000). The NaNs that reach it in practice (arithmetic's 0xFFC00000, a bfloat16 input's NaN
//   widened) have bit 15 clear.
//
// Functions are static (internal linkage, one copy per translation unit, as the copies this
// header replaces had): the libraries are built with different -m flags, and an exported inline
// function could bind one library's calls to another's code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace sgrt::bf16 {

static inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

static inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// A bfloat16's bits as float32 (exact).
static inline float to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// float32 bits u -> bfloat16 bits, rounded to nearest even: adding 0x7FFF plus the kept part's
// lowest bit carries into the kept half exactly when the dropped half is above one half, or is
// one half and the kept half is odd. Infinities stay; finite values past bfloat16's largest
// become infinities. Meaningless for NaNs (callers choose, see above).
static inline uint16_t round_bits(uint32_t u) { return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }

static inline bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// c10::BFloat16's conversion: round to nearest even, NaN -> 0x7FC0. Branch-free (a select), so
// that loops over it vectorize.
static inline uint16_t from_float(float f) {
  const uint32_t u = float_to_bits(f);
  return is_nan_bits(u) ? static_cast<uint16_t>(0x7FC0u) : round_bits(u);
}

// Round to nearest even; a NaN keeps its sign and top payload bits, with the quiet bit set.
// (A branch, as the dense kernel's scalar stores had it: they do not vectorize either way.)
static inline uint16_t from_float_keep_nan(float f) {
  const uint32_t u = float_to_bits(f);
  if (is_nan_bits(u)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return round_bits(u);
}

#if defined(__AVX2__)
// 8 float32 lanes -> 8 bfloat16 bits (round_bits per lane, no NaN test: see the top).
static inline __m128i from_float8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: 4 words, twice (r <= 0xFFFF: no saturation)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

}  // namespace sgrt::bf16
