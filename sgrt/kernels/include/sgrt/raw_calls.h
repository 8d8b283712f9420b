// The raw-call ABI between sgrt's native libraries: how the decode plan (library sgrt_layer,
// sgrt/kernels/layer_ops_cpu/decode_plan.cpp) calls the projection kernels of the other libraries
// (sgrt_woq_avx2: woq_avx2.cpp, sgrt_dense_avx2: dense_avx2.cpp) directly: no dispatcher, no
// tensors, no argument checks and no output allocation per call (~120 calls a decode step).
//
// Each library is its own build (its own .so, compiled and cached on its own), so the two sides
// of a direct call only agree on its signature if they compile against one declaration: this one.
// A provider fills a RawCalls with its functions (a function of another signature does not
// compile), and the consumer checks the struct's size and version where it looks it up, so that
// a library built against another version of this header fails there, with a message, never in
// a call.
//
// Lookup: for an operator `ns::op` with raw calls, its library registers `ns::op_raw_calls() ->
// int`, which returns the address of a static RawCalls (raw_calls_address). DecodePlan::
// set_projection calls it once per projection and checks it (raw_calls_match).
#pragma once

#include <cstdint>

namespace sgrt {

// Bump on any change to the function types below or to RawCalls' fields after `version`.
inline constexpr uint32_t kRawCallsVersion = 1;

// y [M, n] (bfloat16 bits) = x [M, k] (bfloat16 bits) @ a weight-only quantized weight: the
// fused stream `packed` (woq.fuse), `bits` and `group` as the operator takes them. The operator's
// computation, arguments valid (the operator's checks ran once, on an x of no rows).
using WoqRaw = void(const uint16_t* x, int64_t M, const uint8_t* packed, int64_t n, int64_t k, int64_t bits,
                    int64_t group, uint16_t* y);
// y [M, N] = x [M, K] @ w [N, K].T, contiguous rows, bfloat16 bits (bf16) or float32.
using DenseRaw = void(const void* x, int64_t M, const void* w, int64_t N, int64_t K, bool bf16, void* y);
// In-team forms: the same computation's share `part` of `parts` (a split of the output features),
// for a thread of a team the caller runs: no parallel region of their own, no waiting. The parts
// of one y write each output once, with the bits of the per-call form.
using WoqPart = void(const uint16_t* x, int64_t M, const uint8_t* packed, int64_t n, int64_t k, int64_t bits,
                     int64_t group, uint16_t* y, int64_t part, int64_t parts);
using DensePart = void(const void* x, int64_t M, const void* w, int64_t N, int64_t K, bool bf16, void* y,
                       int64_t part, int64_t parts);

struct RawCalls {
  // Fixed in every version: a consumer reads these two first, whatever the provider's layout.
  uint32_t size = 0;     // sizeof(RawCalls) where the provider was compiled
  uint32_t version = 0;  // kRawCallsVersion there
  // A provider fills the pair of its kernel's kind (per call, in team); the other stays null. A
  // null entry sends the consumer to the operator through the dispatcher (per call) or off the
  // thread team (in team).
  WoqRaw* woq_raw = nullptr;
  WoqPart* woq_part = nullptr;
  DenseRaw* dense_raw = nullptr;
  DensePart* dense_part = nullptr;
};

// Provider side: a weight-only quantized kernel's calls, a dense kernel's.
constexpr RawCalls woq_raw_calls(WoqRaw* raw, WoqPart* part) {
  return {sizeof(RawCalls), kRawCallsVersion, raw, part, nullptr, nullptr};
}
constexpr RawCalls dense_raw_calls(DenseRaw* raw, DensePart* part) {
  return {sizeof(RawCalls), kRawCallsVersion, nullptr, nullptr, raw, part};
}

// What `<op>_raw_calls() -> int` returns (the dispatcher's int is int64_t).
inline int64_t raw_calls_address(const RawCalls& calls) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(&calls));
}

// Consumer side: whether calls was built with this header's layout and signatures.
inline bool raw_calls_match(const RawCalls& calls) {
  return calls.size == sizeof(RawCalls) && calls.version == kRawCallsVersion;
}

}  // namespace sgrt
