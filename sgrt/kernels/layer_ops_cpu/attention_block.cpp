// The attention block's operators (torch.ops.sgrt_layer.*, registered in register.cpp): store_kv_
// (new keys and values into their pool slots) and decode_attention_qkv_ (a decode layer's whole
// attention from the QKV projection's output: rotary, q's pre-scale, the K/V store and the
// attention, in one call).

#include <algorithm>
#include <cstring>

#include "attention.h"
#include "attention_block.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// ---- KV pool write -----------------------------------------------------------------------------
// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for every new token t (both caches in place);
// k / v [T, Hkv, D] may be strided views (the QKV projection's output) with a contiguous last dim.
// An int8 pool (k_scale / v_scale given, caches int8): each (token, kv head) row's codes and scale.

void check_new_slots(const Tensor& new_slots, int64_t b, int64_t num_slots) {
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.dim() == 1 && new_slots.size(0) == b &&
                  new_slots.is_contiguous(),
              "new_slots must be a contiguous int64 [B], one slot a row");
  const int64_t* sl = new_slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < num_slots, "slot ", sl[i], " outside the pool's ", num_slots, " slots");
  }
}

// The checks of an int8 pool's scales beside its caches (none: caches of one float dtype).
void check_kv_scales(const Tensor& k_cache, const Tensor& v_cache, const Tensor* k_scale, const Tensor* v_scale) {
  TORCH_CHECK((k_scale == nullptr) == (v_scale == nullptr), "give k_scale and v_scale both or neither");
  if (!k_scale) return;
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar,
              "with k_scale / v_scale the caches must be int8");
  for (const Tensor* s : {k_scale, v_scale}) {
    TORCH_CHECK(s->dim() == 2 && s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) &&
                    s->is_contiguous() && s->scalar_type() == at::kFloat,
                "k_scale and v_scale must be contiguous float32 [slots, kv_heads] beside int8 caches");
  }
}

void store_kv_(Tensor k_cache, Tensor v_cache, const Tensor& slots, const Tensor& k, const Tensor& v,
               const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [slots, kv_heads, head_dim] of one dtype");
  const Tensor* ks = opt_ptr(k_scale);
  check_kv_scales(k_cache, v_cache, ks, opt_ptr(v_scale));
  int64_t num_slots = k_cache.size(0), hkv = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots must be int64 [T]");
  int64_t t = slots.size(0);
  for (const Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == t && x->size(1) == hkv && x->size(2) == d && x->stride(2) == 1 &&
                    (ks ? x->scalar_type() == v.scalar_type() : x->scalar_type() == k_cache.scalar_type()),
                "k and v must be [T, kv_heads, head_dim] in the cache's dtype (an int8 cache: one float dtype) with "
                "a contiguous last dim");
  }
  if (ks) check_cpu_float(k, "k");
  check_new_slots(slots, t, num_slots);
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  if (ks) {  // an int8 pool: each (token, kv head) row quantized (quantize_row_int8)
    int8_t* kc = k_cache.data_ptr<int8_t>();
    int8_t* vc = v_cache.data_ptr<int8_t>();
    float* kss = k_scale->data_ptr<float>();
    float* vss = v_scale->data_ptr<float>();
    dispatch_float(k.scalar_type(), [&]<typename scalar_t>() {
      using R = raw<scalar_t>;
      const R* kp = reinterpret_cast<const R*>(k.const_data_ptr());
      const R* vp = reinterpret_cast<const R*>(v.const_data_ptr());
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t hd = 0; hd < hkv; ++hd) {
          const int64_t at = sl[i] * hkv + hd;
          kss[at] = quantize_row_int8(kp + i * k.stride(0) + hd * k.stride(1), d, kc + at * d);
          vss[at] = quantize_row_int8(vp + i * v.stride(0) + hd * v.stride(1), d, vc + at * d);
        }
      }
    });
    return;
  }
  size_t bytes = static_cast<size_t>(d) * k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  int64_t es = k_cache.element_size();
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t hd = 0; hd < hkv; ++hd) {
      size_t dst = (static_cast<size_t>(sl[i]) * hkv + hd) * bytes;
      std::memcpy(kc + dst, kp + (i * k.stride(0) + hd * k.stride(1)) * es, bytes);
      std::memcpy(vc + dst, vp + (i * v.stride(0) + hd * v.stride(1)) * es, bytes);
    }
  }
}

// ---- a decode layer's attention block in one call --------------------------------------------
// decode_attention_qkv_: qkv [B, H + 2 Hkv, D] or [B, (H + 2 Hkv) * D] (the QKV projection's output, one
// token per row):
// q and k heads rotated in place as rotary_ does, q multiplied by q_scale in place (rounded to
// the dtype, as the eager `q * q_scale`; skipped when 1), k / v stored at new_slots [B] as
// store_kv_ does, then decode_attention of q over each row's slots. What rotary_heads_, a split,
// store_kv_ and decode_attention do, in one dispatch instead of four.

namespace {

// The first part of decode_attention_qkv_: rotary, q's pre-scale, the K/V store (prepare_heads
// without bias or q / k norm); returns q [B, n_heads, D] (a view of qkv) for the attention.
Tensor prepare_qkv_(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t n_heads, double q_scale,
                    Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor* k_scale,
                    const Tensor* v_scale) {
  check_cpu_float(qkv, "qkv");
  TORCH_CHECK((qkv.dim() == 2 || qkv.dim() == 3) && k_cache.dim() == 3,
              "qkv must be [B, heads * head_dim] or [B, heads, head_dim] and k_cache [slots, kv_heads, head_dim]");
  const int64_t hkv = k_cache.size(1), d = k_cache.size(2);
  if (qkv.dim() == 2) {
    TORCH_CHECK(qkv.stride(1) == 1 && qkv.size(1) % std::max<int64_t>(d, 1) == 0,
                "a 2-D qkv must be [B, heads * head_dim] with a contiguous last dim");
    qkv = qkv.view({qkv.size(0), -1, d});
  }
  TORCH_CHECK(n_heads > 0 && hkv > 0 && qkv.size(1) == n_heads + 2 * hkv, "qkv must have n_heads + 2 * kv_heads = ",
              n_heads + 2 * hkv, " heads, got ", qkv.size(1));
  TORCH_CHECK(qkv.size(2) == d && qkv.stride(2) == 1, "qkv's head_dim must be the cache's ", d,
              ", with a contiguous last dim");
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  const int64_t b = qkv.size(0);
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({b, d}) && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous [B, head_dim] in qkv's dtype");
  const auto cache_dtype = k_scale ? at::kChar : qkv.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == cache_dtype && v_cache.scalar_type() == cache_dtype,
              "k_cache and v_cache must be contiguous [slots, kv_heads, head_dim] in qkv's dtype (int8 with scales)");
  check_kv_scales(k_cache, v_cache, k_scale, v_scale);
  check_new_slots(new_slots, b, k_cache.size(0));
  dispatch_float(qkv.scalar_type(), [&]<typename scalar_t>() {
    using R = raw<scalar_t>;
    HeadPrep<R> a{raw_ptr<scalar_t>(qkv), qkv.stride(0), qkv.stride(1), b, n_heads, hkv, d};
    a.cos = raw_ptr<scalar_t>(cos);
    a.sin = raw_ptr<scalar_t>(sin);
    a.q_scale = static_cast<float>(q_scale);
    if (k_scale) {
      a.k_codes = k_cache.data_ptr<int8_t>();
      a.v_codes = v_cache.data_ptr<int8_t>();
      a.k_scale = k_scale->data_ptr<float>();
      a.v_scale = v_scale->data_ptr<float>();
    } else {
      a.k_cache = raw_ptr<scalar_t>(k_cache);
      a.v_cache = raw_ptr<scalar_t>(v_cache);
    }
    a.slots = new_slots.const_data_ptr<int64_t>();
    prepare_heads(a, 0, b * (n_heads + 2 * hkv));
  });
  return qkv.narrow(1, 0, n_heads);
}

// out: a [B, n_heads * head_dim] buffer to write the attention into, or undefined.
Tensor decode_attention_qkv_into(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t n_heads, double q_scale,
                                 Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor& slots,
                                 const Tensor& kv_lens, Tensor out, const Tensor* k_scale, const Tensor* v_scale) {
  // the attention's checks first (prepare_qkv_ makes its own), so that a call that raises on its
  // tables or caches has written nothing to the caches (its context slots are checked in the items)
  TORCH_CHECK(qkv.dim() >= 1 && k_cache.dim() == 3, "qkv must be [B, ...] and k_cache [slots, kv_heads, head_dim]");
  check_cache_and_tables(k_cache, v_cache, qkv.scalar_type(), qkv.size(0), n_heads, k_cache.size(2), slots,
                         kv_lens.contiguous(), k_scale, v_scale);
  Tensor q = prepare_qkv_(std::move(qkv), cos, sin, n_heads, q_scale, k_cache, v_cache, new_slots, k_scale, v_scale);
  return decode_attention_into(q, k_cache, v_cache, slots, kv_lens, out, k_scale, v_scale);
}

}  // namespace

Tensor decode_attention_qkv_(Tensor qkv, const Tensor& cos, const Tensor& sin, int64_t n_heads, double q_scale,
                             Tensor k_cache, Tensor v_cache, const Tensor& new_slots, const Tensor& slots,
                             const Tensor& kv_lens, const std::optional<Tensor>& k_scale,
                             const std::optional<Tensor>& v_scale) {
  return decode_attention_qkv_into(qkv, cos, sin, n_heads, q_scale, k_cache, v_cache, new_slots, slots, kv_lens,
                                   Tensor(), opt_ptr(k_scale), opt_ptr(v_scale));
}

}  // namespace sgrt_layer
