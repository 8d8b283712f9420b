// Decode attention over the KV pool (attention.cpp): what the decode plan and the attention
// block need of it. One query per row; each row's context is a list of pool slots.
#pragma once

#include <optional>
#include <vector>

#include "common.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// Flash decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): a context
// longer than kDecodeChunk keys is split into chunks of kDecodeChunk keys; every (row, kv head,
// chunk) is one work item that computes its chunk's max score, sum of exponentials and
// unnormalised output, and the chunks of a (row, kv head) are merged in chunk order by their
// log-sum-exp. The chunk size is fixed (not derived from the thread count), so the result does
// not depend on the thread count; a context of one chunk or less is one item that normalises
// directly, as the kernel did before it split long contexts.
constexpr int64_t kDecodeChunk = 256;

// One work item: keys [c0, c0 + n) of row r's context for its query heads [q0, q1) (each against
// its own kv head q / g; an item may span kv heads). Each query head's scores, softmax and output
// are computed on their own (the same instructions whichever heads share an item), so how the
// heads are grouped into items changes which thread computes a head, not its bits.
struct AttendItem {
  int64_t r, c0, n;
  int64_t part0;  // the partial of this chunk's kv head 0 (head q's: part0 + q / g); -1: the row's
                  // only chunk, written to out directly
  int64_t q0, q1;
};

// The work of one decode attention call, which depends only on the rows' context lengths, the
// heads and the number of threads (so the decode plan makes it once a step per slot table and
// every layer of that table reuses it): the items, and the (row, kv head, query head) triples of
// split rows whose chunks' partials are merged afterwards.
struct AttendWork {
  int64_t g = 0, hkv = 0, d = 0;
  int64_t span = 0;       // scores buffer stride: the longest item's keys
  int64_t part_size = 0;  // floats a partial: g maxima, g sums, g * d unnormalised outputs
  std::vector<AttendItem> items;
  std::vector<int64_t> merges;      // (r * hkv + kh) * g + i, rows of more than one chunk
  std::vector<int64_t> first_part;  // per row: its chunk 0, kv head 0's partial (-1: one chunk)
  std::vector<float> partials;      // [partials, part_size]
  std::vector<int64_t> shares;      // [threads + 1]: thread t's items are [shares[t], shares[t + 1])
};

// Where an attention call reads and writes: q [B, H, D] (strides qs0, qs1; last dim contiguous),
// the caches [num_slots, hkv, D], the slot tables, out [B, H * D]; q, out and the caches in one
// dtype, or the caches int8 codes with float32 scales ks / vs [num_slots, hkv] (an int8 KV pool:
// a key's value is code * scale; the kernels multiply a key's score by its K scale and a value's
// softmax weight by its V scale, so no row is dequantized: the codes are widened in registers, or
// on AVX-512 VNNI CPUs summed in integers against a quantized query and quantized weights).
struct AttendArgs {
  const void* q;
  int64_t qs0, qs1;
  const void* k;
  const void* v;
  int64_t num_slots;
  const int64_t* sl;  // [B, max_kv]
  const int64_t* ln;  // [B]
  int64_t max_kv;
  void* out;
  const float* ks = nullptr;  // int8 caches' scales, else null (both or neither)
  const float* vs = nullptr;
};

// The items and merges of one call: rows of context lengths ln[0..b) (each at most max_kv), h
// query heads over hkv kv heads of d values, for `threads` threads (attention.cpp). whole_rows: an
// item is a (row, chunk)'s every query head (its keys' whole rows), else one kv head's; either
// cut into ranges of query heads where the items would not divide evenly among few threads.
void plan_attention(AttendWork& w, int64_t b, int64_t h, int64_t hkv, int64_t d, const int64_t* ln, int64_t max_kv,
                    int64_t threads, bool whole_rows);
// Whether items over a pool of this kind take whole rows (an int8 pool read by the integer loops:
// AVX-512 VNNI, head_dim a multiple of 64 up to 256).
bool attends_whole_rows(bool int8_pool, int64_t d);
// Thread `part` of `parts`' share of w's items (merges: of its merges); false, *bad_slot set, where
// an item met a slot outside the pool.
bool attend_share(at::ScalarType dtype, const AttendArgs& a, AttendWork& w, bool merges, int64_t part, int64_t parts,
                  int64_t* bad_slot);
// The checks of the caches [slots, kv heads, d] (in `dtype`, or int8 with k_scale / v_scale
// float32 [slots, kv heads]; scales given for both or neither) and the slot tables of a q of b
// rows, h heads.
void check_cache_and_tables(const Tensor& k_cache, const Tensor& v_cache, at::ScalarType dtype, int64_t b, int64_t h,
                            int64_t d, const Tensor& slots, const Tensor& kv_lens, const Tensor* k_scale = nullptr,
                            const Tensor* v_scale = nullptr);
AttendArgs attend_args(const void* q, int64_t qs0, int64_t qs1, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slots, const Tensor& kv_lens, Tensor& out, const Tensor* k_scale = nullptr,
                       const Tensor* v_scale = nullptr);
// The operator, into `out` where defined; the plan calls it outside a thread team.
Tensor decode_attention_into(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                             const Tensor& kv_lens, Tensor out, const Tensor* k_scale = nullptr,
                             const Tensor* v_scale = nullptr);
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                        const Tensor& kv_lens, const std::optional<Tensor>& k_scale,
                        const std::optional<Tensor>& v_scale);
// An optional tensor as a pointer (null: none).
inline const Tensor* opt_ptr(const std::optional<Tensor>& t) { return t && t->defined() ? &*t : nullptr; }

}  // namespace sgrt_layer
