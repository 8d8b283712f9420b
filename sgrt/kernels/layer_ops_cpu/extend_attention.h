// Extend (prefill) attention over the KV pool (extend_attention.cpp): rows of several new queries
// after a cached prefix, bfloat16, keys and values read from their pool slots.
#pragma once

#include "common.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// Whether this build has the kernel: compiled for a CPU with AVX-512 BF16 (vdpbf16ps). Where it
// is false, extend_attention raises and the caller keeps gather + SDPA.
bool extend_attention_supported();

// q [T, H, D] bfloat16 (last dim contiguous; rows' tokens one after another: row b's q_lens[b]
// queries, then row b + 1's); k_cache / v_cache [S, Hkv, D] bfloat16 contiguous; slots [B, L]
// int64 (row b's context is slots[b, :kv_lens[b]], its new tokens the last q_lens[b]); kv_lens,
// q_lens [B] int64 with 1 <= q_lens[b] <= kv_lens[b] <= L and sum(q_lens) = T; D 64, 128 or 256.
// Returns [T, H * D] bfloat16: causal softmax attention with scale 1 / sqrt(D), query i of row b
// (position kv_lens[b] - q_lens[b] + i) over that row's keys 0..its position.
Tensor extend_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                        const Tensor& kv_lens, const Tensor& q_lens);

}  // namespace sgrt_layer
