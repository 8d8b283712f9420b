// Dense linear layers y = x @ W.T for decode-sized inputs (a few rows of x) on AVX2 + FMA CPUs:
// weights float32 or bfloat16 in PyTorch's own row-major [N, K] layout (no repacking), each read
// once per call, whatever the number of rows M.
//
// Order of work: the output features (weight rows) are split across threads in contiguous ranges
// (at::parallel_for). A thread cuts its range into STREAMS (4) equal contiguous parts and walks
// them side by side: group i is row i of each part, so the thread reads 4 sequential streams of
// weights at once, far apart in memory (the few rows left over by the cut form one last group of
// adjacent rows). Per group, the rows of x one after the other (the group's weight rows stay in L1
// for the next row of x), each x row against the group's rows side by side (sharing each load of
// x). Per (x row, weight row) pair, K in steps of 16: two fp32 accumulators (the first and second
// half of each step), fp32 FMAs, then acc0 + acc1 and a fixed horizontal sum; one rounding to the
// output dtype (nearest even for bfloat16). Every output is computed by the same instructions in
// the same order whatever M, N, the group it falls in or the thread split, so a row's result does
// not depend on the other rows, the other outputs or the thread count (bitwise); the streams
// changed which outputs are computed together, not any output's arithmetic (bitwise the same as
// the one-row-at-a-time kernel before them).
//
// Why streams: a batch-1 decode step streams every weight once from DRAM, and one core's share of
// the read bandwidth is set by how many cache-line misses it keeps in flight. One sequential
// stream a thread (one weight row after the other) left that to the hardware prefetcher and
// reached 6.8 GB/s (bfloat16) / 10.7 GB/s (float32) on one core of the 2-core AVX2 EPYC, a
// fraction of what the memory delivers. 4 far-apart streams measured 1.5-1.8x that, one thread
// (bench/dense_kernel.py --ab; from L3 1.4-1.5x), at or above torch.sum's one-thread read rate;
// 2 streams 1.3x, 5 / 6 / 8 streams less than 4 (8 x 2 accumulators spill the 16 ymm
// registers). Adjacent weight rows side by side (4 rows of the same 4.6 KB stretch) measured
// slower than one row at a time, and software prefetch (0.2-8 KB ahead, T0 / T1 / NTA hints)
// added nothing on top of 4 streams (0.9-1.05x).
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

#include "sgrt/bf16.h"
#include "sgrt/raw_calls.h"

namespace {

// Weight rows read side by side a thread: sequential streams far apart (see the header). (The
// macro lets bench experiments build variants; 1 is one row at a time.)
#ifndef SGRT_DENSE_STREAMS
#define SGRT_DENSE_STREAMS 4
#endif
constexpr int STREAMS = SGRT_DENSE_STREAMS;
static_assert(STREAMS >= 1 && STREAMS <= 4, "STREAMS x 2 accumulators must fit the 16 ymm registers");
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

// R (1..STREAMS) weight rows w[0..R) times one x row (the padded fp32 buffer): full steps from
// the weights themselves, the tail step from wtail ([R][16], zero padded).
template <typename T, int R>
inline void dot_rows(const T* const* w, int64_t K, const T* wtail, const float* x, float* out) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const int64_t full = K / STEP_K * STEP_K;
  for (int64_t k = 0; k < full; k += STEP_K) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 a, b;
      load16<T>(w[r] + k, a, b);
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

// x as fp32, zero padded to KP, for one call: per thread, grown and never shrunk, so that a decode
// step's ~120 calls allocate nothing (the plan calls dense_raw below directly).
float* x_buffer(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// x [M, K] (rows xs apart) as fp32, zero padded to KP = K rounded up to 16, into this thread's
// buffer; for bfloat16, each 16-step holds the even inputs then the odd.
template <typename T>
float* widen_x(const T* xp, int64_t M, int64_t xs, int64_t K) {
  const int64_t KP = (K + STEP_K - 1) / STEP_K * STEP_K;
  float* const xf = x_buffer(M * KP);
  std::fill(xf, xf + M * KP, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const T* src = xp + m * xs;
    float* dst = xf + m * KP;
    for (int64_t k = 0; k < K; ++k) {
      float v;
      if constexpr (std::is_same_v<T, float>) {
        v = src[k];
      } else {
        v = sgrt::bf16::to_float(src[k]);
      }
      const int64_t base = k / STEP_K * STEP_K, j = k % STEP_K;
      dst[std::is_same_v<T, float> ? k : base + (j % 2) * 8 + j / 2] = v;
    }
  }
  return xf;
}

// Outputs r0..r1 of every row of y [M, N] from x widened (widen_x) and w [N, K]: the kernel's one
// computation, run by the per-call entry (run, a range per thread) and the in-team one (dense_part).
template <typename T>
void rows_range(const float* xf, int64_t M, const T* wp, int64_t N, int64_t K, T* yp, int64_t r0, int64_t r1) {
  const int64_t KP = (K + STEP_K - 1) / STEP_K * STEP_K;
  const int64_t full = K / STEP_K * STEP_K, tail = K - full;
  T wtail[STREAMS * STEP_K];
  const T* rows[STREAMS];
  int64_t idx[STREAMS];
  float out[STREAMS];
  // One group: R weight rows idx[0..R), every row of x against them while they are in L1.
  auto group = [&](int R) {
    for (int r = 0; r < R; ++r) rows[r] = wp + idx[r] * K;
    if (tail) {
      std::memset(wtail, 0, sizeof(wtail));
      for (int r = 0; r < R; ++r) std::memcpy(wtail + r * STEP_K, rows[r] + full, tail * sizeof(T));
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = xf + m * KP;
      switch (R) {  // (R <= STREAMS)
        case 4: dot_rows<T, 4>(rows, K, wtail, xm, out); break;
        case 3: dot_rows<T, 3>(rows, K, wtail, xm, out); break;
        case 2: dot_rows<T, 2>(rows, K, wtail, xm, out); break;
        default: dot_rows<T, 1>(rows, K, wtail, xm, out); break;
      }
      T* yrow = yp + m * N;
      for (int r = 0; r < R; ++r) {
        if constexpr (std::is_same_v<T, float>) yrow[idx[r]] = out[r];
        else yrow[idx[r]] = sgrt::bf16::from_float_keep_nan(out[r]);  // (a NaN keeps its sign: as before)
      }
    }
  };
  const int64_t part = (r1 - r0) / STREAMS;  // rows in each of the STREAMS parts
  for (int64_t i = 0; i < part; ++i) {
    for (int s = 0; s < STREAMS; ++s) idx[s] = r0 + s * part + i;
    group(STREAMS);
  }
  const int64_t left = (r1 - r0) - STREAMS * part;  // < STREAMS rows: one group of adjacent rows
  for (int r = 0; r < left; ++r) idx[r] = r0 + STREAMS * part + r;
  if (left) group(static_cast<int>(left));
}

// y [M, N] = x [M, K] (rows xs apart) @ w [N, K].T, T float (float32) or uint16_t (bfloat16 bits).
template <typename T>
void run(const T* xp, int64_t M, int64_t xs, const T* wp, int64_t N, int64_t K, T* yp) {
  const float* const xf = widen_x(xp, M, xs, K);  // (the calling thread's buffer, read by the team)
  // ~64 KiB of weights a task at least, so that small layers do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) { rows_range(xf, M, wp, N, K, yp, r0, r1); });
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
  if (w.scalar_type() == at::kFloat)
    run<float>(x.data_ptr<float>(), x.size(0), x.stride(0), w.data_ptr<float>(), w.size(0), w.size(1), y.data_ptr<float>());
  else
    run<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), x.stride(0),
                  reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(0), w.size(1),
                  reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}

// y [M, N] = x [M, K] @ w [N, K].T on raw storage (contiguous rows; bf16: bfloat16 bits, else
// float32), arguments valid (dense_linear checks them): sgrt::DenseRaw (sgrt/raw_calls.h), what
// the decode plan (sgrt/kernels/layer_ops_cpu/decode_plan.cpp) calls directly.
void dense_raw(const void* x, int64_t M, const void* w, int64_t N, int64_t K, bool bf16, void* y) {
  if (M == 0) return;
  if (bf16)
    run<uint16_t>(static_cast<const uint16_t*>(x), M, K, static_cast<const uint16_t*>(w), N, K, static_cast<uint16_t*>(y));
  else
    run<float>(static_cast<const float*>(x), M, K, static_cast<const float*>(w), N, K, static_cast<float*>(y));
}

// dense_raw's part `part` of `parts`, for a thread of a team the caller already runs (the decode
// plan's one OpenMP region a step): this thread widens x into its own buffer and computes outputs
// [N * part / parts, N * (part + 1) / parts) of every row. No parallel region, no wait; the same
// bits as dense_raw (an output does not depend on the split): sgrt::DensePart.
void dense_part(const void* x, int64_t M, const void* w, int64_t N, int64_t K, bool bf16, void* y, int64_t part,
                int64_t parts) {
  const int64_t r0 = N * part / parts, r1 = N * (part + 1) / parts;
  if (M == 0 || r0 == r1) return;
  if (bf16) {
    const auto* xp = static_cast<const uint16_t*>(x);
    rows_range(widen_x(xp, M, K, K), M, static_cast<const uint16_t*>(w), N, K, static_cast<uint16_t*>(y), r0, r1);
  } else {
    const auto* xp = static_cast<const float*>(x);
    rows_range(widen_x(xp, M, K, K), M, static_cast<const float*>(w), N, K, static_cast<float*>(y), r0, r1);
  }
}

// linear's raw calls for the decode plan (sgrt/raw_calls.h): a signature that differs from the
// declared one does not compile here.
constexpr sgrt::RawCalls kLinearCalls = sgrt::dense_raw_calls(&dense_raw, &dense_part);
int64_t linear_raw_calls() { return sgrt::raw_calls_address(kLinearCalls); }

}  // namespace

TORCH_LIBRARY(sgrt_dense_avx2, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(dense_linear));
  // the address of linear's sgrt::RawCalls, for the decode plan (no tensor arguments: a catch-all kernel)
  m.def("linear_raw_calls() -> int", &linear_raw_calls);
}
