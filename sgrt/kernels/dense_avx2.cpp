// Dense linear layers y = x @ W.T for decode-sized inputs (a few rows of x) on AVX2 + FMA CPUs:
// weights float32 or bfloat16 in PyTorch's own row-major [N, K] layout (no repacking), each read
// once per call, whatever the number of rows M.
//
// Order of work: output features in blocks of 4 weight rows, split across threads
// (at::parallel_for); per block, the rows of x one after the other (the block's 4 weight rows stay
// in L1 for the next row of x), the 4 weight rows side by side (sharing each load of x), or one
// after the other where x has one row. Per (x row, weight row) pair, K in steps of 16: two fp32
// accumulators (the first and second half of each step), fp32 FMAs, then acc0 + acc1 and a fixed
// horizontal sum; one rounding to the output dtype (nearest even for bfloat16). Every output is
// computed by the same instructions in the same order whatever M, the block it falls in or the
// thread split, so a row's result does not depend on the other rows or the thread count
// (bitwise).
//
// bfloat16 weights are widened exactly by shifting: in a 32-bit lane holding the bf16 pair
// (w[2i], w[2i+1]), `lane << 16` is w[2i] as fp32 and `lane & 0xffff0000` is w[2i+1]. x is
// widened once per call into a buffer whose 16-value steps hold the even inputs, then the odd
// ones, matching that order. K's tail (K % 16) is padded with zeros in x and in a copy of the
// weights' tail, so no load reads past a row.
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

constexpr int64_t BLOCK_N = 4;  // weight rows sharing each load of x
constexpr int64_t STEP_K = 16;

inline float hsum_one(__m256 v) {  // the fixed horizontal order used for every output
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(t, t));
}

// 16 weights of one row at step k -> two fp32 vectors in the order of x's buffer.
template <typename T>
inline void load16(const T* w, __m256& a, __m256& b);

template <>
inline void load16<float>(const float* w, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(w);
  b = _mm256_loadu_ps(w + 8);
}

template <>
inline void load16<uint16_t>(const uint16_t* w, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                                 // even inputs
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));  // odd
}

// R (1..4) weight rows starting at w (row stride K) times one x row (the padded fp32 buffer):
// full steps from the weights themselves, the tail step from wtail ([R][16], zero padded).
template <typename T, int R>
inline void dot_rows(const T* w, int64_t K, const T* wtail, const float* x, float* out) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const int64_t full = K / STEP_K * STEP_K;
  for (int64_t k = 0; k < full; k += STEP_K) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 a, b;
      load16<T>(w + r * K + k, a, b);
      acc0[r] = _mm256_fmadd_ps(a, x0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(b, x1, acc1[r]);
    }
  }
  if (full < K) {
    const __m256 x0 = _mm256_loadu_ps(x + full), x1 = _mm256_loadu_ps(x + full + 8);
    for (int r = 0; r < R; ++r) {
      __m256 a, b;
      load16<T>(wtail + r * STEP_K, a, b);
      acc0[r] = _mm256_fmadd_ps(a, x0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(b, x1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum_one(_mm256_add_ps(acc0[r], acc1[r]));
}

inline uint16_t to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t KP = (K + STEP_K - 1) / STEP_K * STEP_K;
  // x as fp32, zero padded to KP; for bfloat16, each 16-step holds the even inputs then the odd.
  std::vector<float> xf(static_cast<size_t>(M * KP), 0.0f);
  const int64_t xs = x.stride(0);
  for (int64_t m = 0; m < M; ++m) {
    const T* src = reinterpret_cast<const T*>(x.data_ptr()) + m * xs;
    float* dst = xf.data() + m * KP;
    for (int64_t k = 0; k < K; ++k) {
      float v;
      if constexpr (std::is_same_v<T, float>) {
        v = src[k];
      } else {
        const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
        std::memcpy(&v, &bits, 4);
      }
      const int64_t base = k / STEP_K * STEP_K, j = k % STEP_K;
      dst[std::is_same_v<T, float> ? k : base + (j % 2) * 8 + j / 2] = v;
    }
  }
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  const int64_t full = K / STEP_K * STEP_K, tail = K - full;
  const int64_t blocks = (N + BLOCK_N - 1) / BLOCK_N;
  // ~64 KiB of weights a task at least, so that small layers do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, BLOCK_N * K * sizeof(T)));
  // One row of x: one weight row at a time (a single read stream per thread; measured 1.3-1.6x
  // faster than 4 interleaved rows at one row of x). More rows: 4 weight rows share each x load.
  const bool single_stream = M == 1;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    T wtail[BLOCK_N * STEP_K];
    float out[BLOCK_N];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK_N;
      const int rows = static_cast<int>(std::min<int64_t>(BLOCK_N, N - n0));
      const T* wb = wp + n0 * K;
      if (tail) {
        std::memset(wtail, 0, sizeof(wtail));
        for (int r = 0; r < rows; ++r) std::memcpy(wtail + r * STEP_K, wb + r * K + full, tail * sizeof(T));
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xf.data() + m * KP;
        if (single_stream) {  // same arithmetic per output, one weight row streamed at a time
          for (int r = 0; r < rows; ++r) dot_rows<T, 1>(wb + r * K, K, wtail + r * STEP_K, xm, out + r);
        } else switch (rows) {
          case 4: dot_rows<T, 4>(wb, K, wtail, xm, out); break;
          case 3: dot_rows<T, 3>(wb, K, wtail, xm, out); break;
          case 2: dot_rows<T, 2>(wb, K, wtail, xm, out); break;
          default: dot_rows<T, 1>(wb, K, wtail, xm, out); break;
        }
        T* yrow = reinterpret_cast<T*>(y.data_ptr()) + m * N + n0;
        for (int r = 0; r < rows; ++r) {
          if constexpr (std::is_same_v<T, float>) yrow[r] = out[r];
          else yrow[r] = to_bf16(out[r]);
        }
      }
    }
  });
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "sgrt_dense_avx2.linear: x and weight must be on the CPU");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "sgrt_dense_avx2.linear: weight must be float32 or bfloat16, got ", w.scalar_type());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "sgrt_dense_avx2.linear: x must have the weight's dtype ",
              w.scalar_type(), ", got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) > 0 && w.size(1) > 0,
              "sgrt_dense_avx2.linear: weight must be a contiguous non-empty [N, K] matrix, got ", w.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "sgrt_dense_avx2.linear: x must be [M, K=", w.size(1),
              "], got ", x.sizes());
  TORCH_CHECK(x.size(0) == 0 || x.size(1) == 1 || x.stride(1) == 1,
              "sgrt_dense_avx2.linear: x's rows must be contiguous (stride 1 along K), got strides ", x.strides());
  at::Tensor y(at::detail::empty_cpu({x.size(0), w.size(0)}, w.scalar_type()));
  if (x.size(0) == 0) return y;
  if (w.scalar_type() == at::kFloat) run<float>(x, w, y);
  else run<uint16_t>(x, w, y);
  return y;
}

}  // namespace

TORCH_LIBRARY(sgrt_dense_avx2, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(dense_linear));
}
