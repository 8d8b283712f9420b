// The decode step in one call: DecodePlan (torch.classes.sgrt_layer.DecodePlan), built once per
// model by sgrt/models/native_step.py, runs the embedding, every decoder layer and the final
// norm on the layer operators (elementwise.h, attention.h, attention_block.h) and the
// projections' own kernels, called directly through their raw calls (sgrt/raw_calls.h) where
// their libraries have them, in one OpenMP thread team a step where it applies.

#include <ATen/Parallel.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <omp.h>

#include "sgrt/raw_calls.h"

#include "attention.h"
#include "attention_block.h"
#include "decode_plan.h"
#include "elementwise.h"

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// ---- the decode step: every decoder layer of the model in one call -------------------------------
// A batch-1 decode step of a small model is bound by per-op overhead, not by its kernels: ~8
// Python -> operator round trips a layer cost more than the layer's norms and attention. DecodePlan
// holds a model's per-layer weights and switches (built once per model by sgrt/models/native_step.py)
// and forward() runs a decode-only forward (every row one new token) through the embedding, every
// layer and the final norm in one call, with per-step buffers reused across layers.
//
// NOTE: it MUST stay in step with DecoderLayer.forward and CausalLM.forward (sgrt/models/layers.py)
// on the native path: the same operators (these ops, the projections' own kernels, and the ATen ops
// that path uses for q/k norm, bias and the embedding), in the same order, so that the hidden
// states and the K/V written are bit-identical; tests/models/test_native_step.py checks every family.

namespace {

using WoqLinear = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                         int64_t);
using DenseLinear = Tensor(const Tensor&, const Tensor&);

// One fused projection: the weight-only quantized kernel's arguments (bits 4 / 8, as GroupLinear
// passes them), or the dense kernel's (bits 0, as DenseLinear passes them); the kernel's raw calls
// where its library has them (sgrt/raw_calls.h: its computation on raw storage behind the
// registered operator, which the plan calls directly: no dispatcher, no argument checks and no
// output allocation per call), else all null.
struct Projection {
  Tensor weight, scales, offsets;
  int64_t n = 0, k = 0, bits = 0, group = 0;
  sgrt::RawCalls calls;
  // the projection's own operator (int4 projections with int8 activations run linear_q8 beside
  // int8 ones on linear in one model)
  std::optional<c10::TypedOperatorHandle<WoqLinear>> woq_op;

  int64_t out_features() const { return bits > 0 ? n : weight.size(0); }
};

// The per-step buffers of DecodePlan::forward: reused across layers and, while the batch size and
// dtype stay, across steps (a decode step allocates only its embedding and its output then).
struct Workspace {
  Tensor attn, qkv, o, gate_up, down;  // written by the team's threads together
  // per thread of the team (one where there is none): the residual stream, the norm that feeds a
  // projection, a norm of a projection's output (sandwich), the gating's output
  std::vector<Tensor> x, h, normed, act;
  std::vector<Tensor> cos, sin;  // per rotary table: the rows of this step's positions [B, head_dim]
  std::vector<AttendWork> attend;  // per slot table: the attention's work items (thread team)

  // slot as a [rows, cols] tensor with `options`, reusing its storage where it has that shape
  static Tensor& get(Tensor& slot, int64_t rows, int64_t cols, const at::TensorOptions& options) {
    if (!slot.defined() || slot.size(0) != rows || slot.size(1) != cols || slot.dtype() != options.dtype()) {
      slot = at::empty({rows, cols}, options);
    }
    return slot;
  }
};

// Where DecodePlan::run's layer loop runs: on the calling thread alone (team false: every
// operator opens its own parallel region, as outside the plan), or as thread `part` of a team of
// `parts` threads that forward() opened once for the whole step (one OpenMP region a step instead
// of one an operator: ~150 for SmolLM2). In a team, the projections and the attention split their
// work by part, and barrier() separates an operator's writes from the next one's reads; an
// exception on one thread is kept (first one wins) and the other threads skip the rest of the step's
// work but still meet every barrier, so none waits forever.
struct TeamState {
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::exception_ptr error;
  std::atomic<bool> bad{false};  // an attention item met a slot outside the pool
  std::atomic<int64_t> bad_slot{0};
};

struct Team {
  int64_t part = 0, parts = 1;
  bool team = false;
  TeamState* state = nullptr;

  bool lead() const { return part == 0; }
  void barrier() const {
    if (team) {
#pragma omp barrier
    }
  }
  // f() here, unless another thread of the team has failed; its exception kept, not thrown, in a team
  template <typename F>
  void run(F&& f) const {
    if (!team) {
      f();
      return;
    }
    if (state->failed.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(state->mutex);
      if (!state->error) state->error = std::current_exception();
      state->failed.store(true);
    }
  }
};

struct PlanLayer {
  Tensor input_norm, post_attention_norm;
  std::optional<Tensor> pre_feedforward_norm, post_feedforward_norm;  // sandwich norms (Gemma 3)
  std::optional<Tensor> q_norm, k_norm, qkv_bias;
  Projection qkv, o, gate_up, down;
  int64_t rope_id = 0;    // which rotary table (Gemma 3's local one for sliding layers)
  int64_t window_id = 0;  // which slot table of forward()'s (one per distinct sliding window)
  double q_scale = 1.0;
  bool gelu = false;  // GELU-tanh gating instead of SiLU
};

struct DecodePlan : torch::CustomClassHolder {
  Tensor embed;                       // [vocab, hidden]
  std::optional<Tensor> embed_scale;  // 0-dim, in the model's dtype
  Tensor final_norm;
  double eps;
  int64_t n_heads, head_dim;
  std::vector<Tensor> cos, sin;  // float32 rotary tables [positions, head_dim]
  std::vector<PlanLayer> layers;
  std::optional<c10::TypedOperatorHandle<DenseLinear>> dense;  // (a woq projection keeps its own operator)
  // forward()'s buffers; a call that finds them in use by another thread makes its own
  mutable std::mutex workspace_mutex;
  mutable Workspace workspace;
  bool raw_entries = true;  // call the kernels' raw entries where they have them (else the dispatcher)
  bool thread_team = true;  // run a step in one thread team where it applies (team_applies)

  DecodePlan(Tensor embed, std::optional<Tensor> embed_scale, Tensor final_norm, double eps, int64_t n_heads,
             int64_t head_dim, std::vector<Tensor> cos, std::vector<Tensor> sin)
      : embed(std::move(embed)), embed_scale(std::move(embed_scale)), final_norm(std::move(final_norm)), eps(eps),
        n_heads(n_heads), head_dim(head_dim), cos(std::move(cos)), sin(std::move(sin)) {
    TORCH_CHECK(this->cos.size() == this->sin.size(), "one sin table per cos table");
    TORCH_CHECK(n_heads > 0 && head_dim > 0 && head_dim % 2 == 0, "n_heads must be positive and head_dim even and ",
                "positive (rotary rotates halves), got ", n_heads, " and ", head_dim);
    for (size_t i = 0; i < this->cos.size(); ++i) {
      TORCH_CHECK(this->cos[i].dim() == 2 && this->cos[i].scalar_type() == at::kFloat && this->cos[i].is_contiguous() &&
                      this->sin[i].scalar_type() == at::kFloat && this->sin[i].is_contiguous() &&
                      this->sin[i].sizes() == this->cos[i].sizes(),
                  "rotary tables must be contiguous float32 [positions, head_dim]");
    }
  }

  void add_layer(Tensor input_norm, Tensor post_attention_norm, std::optional<Tensor> pre_feedforward_norm,
                 std::optional<Tensor> post_feedforward_norm, std::optional<Tensor> q_norm,
                 std::optional<Tensor> k_norm, std::optional<Tensor> qkv_bias, int64_t rope_id, int64_t window_id,
                 double q_scale, bool gelu) {
    TORCH_CHECK(rope_id >= 0 && rope_id < static_cast<int64_t>(cos.size()), "rope_id ", rope_id, " out of range");
    TORCH_CHECK(pre_feedforward_norm.has_value() == post_feedforward_norm.has_value() && q_norm.has_value() == k_norm.has_value(),
                "sandwich norms and q/k norms come in pairs");
    // (the head prep reads these on raw storage: checked here, once; the bias's size against the
    // qkv projection in set_projection)
    for (const auto* v : {&qkv_bias, &q_norm, &k_norm}) {
      TORCH_CHECK(!*v || ((*v)->scalar_type() == embed.scalar_type() && (*v)->is_contiguous() &&
                          (v == &qkv_bias || (*v)->numel() == head_dim)),
                  "a layer's qkv bias / q / k norm must be contiguous, in the model's dtype, the norms of head_dim values");
    }
    PlanLayer l;
    l.input_norm = std::move(input_norm);
    l.post_attention_norm = std::move(post_attention_norm);
    l.pre_feedforward_norm = std::move(pre_feedforward_norm);
    l.post_feedforward_norm = std::move(post_feedforward_norm);
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
    l.qkv_bias = std::move(qkv_bias);
    l.rope_id = rope_id;
    l.window_id = window_id;
    l.q_scale = q_scale;
    l.gelu = gelu;
    layers.push_back(std::move(l));
  }

  // The last added layer's projection `name` (qkv_proj, o_proj, gate_up_proj, down_proj) runs the
  // operator `op` ("sgrt_woq_avx2::linear" and the like with bits 4 / 8, "sgrt_dense_avx2::linear"
  // with bits 0), looked up once here.
  void set_projection(const std::string& name, const std::string& op, Tensor weight, Tensor scales, Tensor offsets,
                      int64_t n, int64_t k, int64_t bits, int64_t group) {
    TORCH_CHECK(!layers.empty(), "add_layer first");
    PlanLayer& l = layers.back();
    Projection* p = name == "qkv_proj" ? &l.qkv : name == "o_proj" ? &l.o : name == "gate_up_proj" ? &l.gate_up
                  : name == "down_proj" ? &l.down : nullptr;
    TORCH_CHECK(p != nullptr, "unknown projection ", name);
    auto& dispatcher = c10::Dispatcher::singleton();
    auto handle = dispatcher.findSchemaOrThrow(op.c_str(), "");
    Projection proj{std::move(weight), std::move(scales), std::move(offsets), n, k, bits, group};
    if (bits > 0) {
      proj.woq_op = handle.typed<WoqLinear>();
      // the operator's own argument checks, once, on an x of no rows (the raw calls skip them)
      proj.woq_op->call(at::empty({0, k}, at::kBFloat16), proj.weight, proj.scales, proj.offsets, n, k, bits, group);
    } else {
      dense = handle.typed<DenseLinear>();
      TORCH_CHECK(proj.weight.dim() == 2, "a dense projection's weight must be [N, K]");
      dense->call(at::empty({0, proj.weight.size(1)}, proj.weight.options()), proj.weight);
    }
    // The operator's raw calls, if its library has them (`<op>_raw_calls() -> int`: their address),
    // checked here, once: a library built against another sgrt/raw_calls.h is an error now rather
    // than a call through a mismatched signature later. Only this projection's kind is kept.
    if (auto entry = dispatcher.findSchema({op + "_raw_calls", ""})) {
      const auto* calls = reinterpret_cast<const sgrt::RawCalls*>(static_cast<intptr_t>(entry->typed<int64_t()>().call()));
      TORCH_CHECK(calls != nullptr, op, "_raw_calls gave a null address");
      TORCH_CHECK(sgrt::raw_calls_match(*calls), op, "_raw_calls: raw-call ABI version ", calls->version, " (",
                  calls->size, " bytes), but sgrt_layer was built for version ", sgrt::kRawCallsVersion, " (",
                  sizeof(sgrt::RawCalls), " bytes) of sgrt/raw_calls.h: the native libraries loaded in this ",
                  "process were built from different sources");
      if (bits > 0) {
        proj.calls.woq_raw = calls->woq_raw;
        proj.calls.woq_part = calls->woq_part;
      } else {
        proj.calls.dense_raw = calls->dense_raw;
        proj.calls.dense_part = calls->dense_part;
      }
    }
    *p = std::move(proj);
    TORCH_CHECK(p != &l.qkv || !l.qkv_bias || l.qkv_bias->numel() == p->out_features(), "the qkv bias has ",
                l.qkv_bias ? l.qkv_bias->numel() : 0, " values, the qkv projection ", p->out_features(), " features");
  }

  // p's output for x [B, in] (contiguous, the model's dtype): written into `out` (resized to
  // [B, out features]) by the raw entry, else the operator's own new tensor. In a team (t.team),
  // this thread's share of it by the in-team entry into `out`, which forward() sized beforehand.
  Tensor project(const Projection& p, const Tensor& x, Tensor& out, const Team& t) const {
    TORCH_CHECK(p.weight.defined(), "a projection was not set");
    if (p.bits > 0) {
      if (!t.team && (p.calls.woq_raw == nullptr || !raw_entries))
        return p.woq_op->call(x, p.weight, p.scales, p.offsets, p.n, p.k, p.bits, p.group);
      TORCH_CHECK(x.dim() == 2 && x.size(1) == p.k && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
                  "a projection's input must be contiguous bfloat16 [B, ", p.k, "]");
      const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
      const uint8_t* wp = p.weight.const_data_ptr<uint8_t>();
      if (t.team) {
        TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == p.n, "the team's buffers were sized for other layers");
        p.calls.woq_part(xp, x.size(0), wp, p.n, p.k, p.bits, p.group, reinterpret_cast<uint16_t*>(out.data_ptr()), t.part,
                   t.parts);
        return out;
      }
      Workspace::get(out, x.size(0), p.n, x.options());
      p.calls.woq_raw(xp, x.size(0), wp, p.n, p.k, p.bits, p.group, reinterpret_cast<uint16_t*>(out.data_ptr()));
      return out;
    }
    if (!t.team && (p.calls.dense_raw == nullptr || !raw_entries)) return dense->call(x, p.weight);
    const int64_t n = p.weight.size(0), k = p.weight.size(1);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous() && x.scalar_type() == p.weight.scalar_type(),
                "a projection's input must be contiguous [B, ", k, "] in the weight's dtype");
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    if (t.team) {
      TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n, "the team's buffers were sized for other layers");
      p.calls.dense_part(x.const_data_ptr(), x.size(0), p.weight.const_data_ptr(), n, k, bf16, out.data_ptr(), t.part,
                   t.parts);
      return out;
    }
    Workspace::get(out, x.size(0), n, x.options());
    p.calls.dense_raw(x.const_data_ptr(), x.size(0), p.weight.const_data_ptr(), n, k, bf16, out.data_ptr());
    return out;
  }

  // Whether projections call the kernels' raw entries (default) or their operators through the
  // dispatcher (the path of a kernel library without one); the same bits either way (tests).
  // Returns the number of projections that have a raw entry.
  int64_t use_raw_entries(bool enable) {
    raw_entries = enable;
    int64_t n = 0;
    for (const PlanLayer& l : layers)
      for (const Projection* p : {&l.qkv, &l.o, &l.gate_up, &l.down}) n += p->calls.woq_raw || p->calls.dense_raw;
    return n;
  }

  // Whether a step may run in one thread team (default) or every operator opens its own parallel
  // region; the same bits either way (tests). Returns whether a step on this thread would now.
  bool use_thread_team(bool enable) {
    thread_team = enable;
    at::internal::lazy_init_num_threads();
    return team_applies();
  }

  // input_ids, positions [B] int64 (one new token a row); k_layers / v_layers: the KV pool's
  // layers; new_slots [B]: where each row's new K/V go; slots[w] [B, max_kv] / kv_lens[w] [B]:
  // each row's context for the layers of window_id w (PagedAttention.native_decode's tables).
  // -> the final hidden states [B, hidden] in the model's dtype.
  // `embedded`: the rows of input_ids already looked up ([B, hidden], the model's dtype), for a
  // model whose table is quantized (its Python module reads it); otherwise `embed` is the table.
  // k_scales / v_scales: an int8 pool's per-layer scales [num_slots, kv heads] (its k_layers /
  // v_layers int8), or empty (K/V in the model's dtype).
  Tensor forward(const Tensor& input_ids, const Tensor& positions, std::vector<Tensor> k_layers,
                 std::vector<Tensor> v_layers, const Tensor& new_slots, std::vector<Tensor> slots,
                 std::vector<Tensor> kv_lens, std::optional<Tensor> embedded, std::vector<Tensor> k_scales,
                 std::vector<Tensor> v_scales) const {
    std::unique_lock<std::mutex> lock(workspace_mutex, std::try_to_lock);
    Workspace own;  // (only where another thread is in forward() with the plan's workspace)
    return run(lock.owns_lock() ? workspace : own, input_ids, positions, k_layers, v_layers, new_slots, slots,
               kv_lens, embedded, k_scales, v_scales);
  }

  // The rows of the rotary tables at `positions` in `dtype` into ws.cos / ws.sin: what
  // cos.index_select(0, positions).to(dtype) gives (round to nearest even for bfloat16).
  void rope_rows(Workspace& ws, const Tensor& positions, at::ScalarType dtype) const {
    TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
                "positions must be a contiguous int64 [B]");
    const int64_t b = positions.size(0);
    const int64_t* pos = positions.const_data_ptr<int64_t>();
    ws.cos.resize(cos.size());
    ws.sin.resize(sin.size());
    for (size_t i = 0; i < cos.size(); ++i) {
      const int64_t rows = cos[i].size(0), d = cos[i].size(1);  // (tables checked at construction)
      for (auto [table, out] : {std::pair{&cos[i], &ws.cos[i]}, std::pair{&sin[i], &ws.sin[i]}}) {
        Workspace::get(*out, b, d, at::TensorOptions().dtype(dtype));
        const float* src = table->const_data_ptr<float>();
        dispatch_float(dtype, [&]<typename scalar_t>() {
          using R = raw<scalar_t>;
          R* dst = raw_ptr<scalar_t>(*out);
          for (int64_t r = 0; r < b; ++r) {
            TORCH_CHECK(pos[r] >= 0 && pos[r] < rows, "position ", pos[r], " out of the rotary table's ", rows);
            for (int64_t j = 0; j < d; ++j) dst[r * d + j] = from_f<R>(src[pos[r] * d + j]);
          }
        });
      }
    }
  }

  // Layer l's prepare_heads on this thread's share of the step's (row, head) items (all of them
  // outside a team). qkv: the QKV projection's output, contiguous [B, (heads + 2 kv heads) *
  // head_dim]; its bias, norms, the rotary rows and the slots were checked by run().
  void prepare_share(const PlanLayer& l, const Tensor& qkv, const Workspace& ws, const Tensor& k_cache,
                     const Tensor& v_cache, const Tensor& new_slots, const Team& t, const Tensor* k_scale,
                     const Tensor* v_scale) const {
    TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "a QKV projection's output must be contiguous [B, features]");
    const int64_t b = qkv.size(0), hkv = k_cache.size(1), n = b * (n_heads + 2 * hkv);
    dispatch_float(qkv.scalar_type(), [&]<typename scalar_t>() {
      using R = raw<scalar_t>;
      HeadPrep<R> a{raw_ptr<scalar_t>(qkv), qkv.size(1), head_dim, b, n_heads, hkv, head_dim};
      if (l.qkv_bias) a.bias = raw_ptr<scalar_t>(*l.qkv_bias);
      if (l.q_norm) {
        a.q_norm = raw_ptr<scalar_t>(*l.q_norm);
        a.k_norm = raw_ptr<scalar_t>(*l.k_norm);
        a.eps = static_cast<float>(eps);
      }
      a.cos = raw_ptr<scalar_t>(ws.cos[l.rope_id]);
      a.sin = raw_ptr<scalar_t>(ws.sin[l.rope_id]);
      a.q_scale = static_cast<float>(l.q_scale);
      if (k_scale) {  // an int8 pool (checked by run())
        a.k_codes = static_cast<int8_t*>(k_cache.data_ptr());
        a.v_codes = static_cast<int8_t*>(v_cache.data_ptr());
        a.k_scale = static_cast<float*>(k_scale->data_ptr());
        a.v_scale = static_cast<float*>(v_scale->data_ptr());
      } else {
        a.k_cache = raw_ptr<scalar_t>(k_cache);
        a.v_cache = raw_ptr<scalar_t>(v_cache);
      }
      a.slots = new_slots.const_data_ptr<int64_t>();
      prepare_heads(a, n * t.part / t.parts, n * (t.part + 1) / t.parts);
    });
  }

  // Whether this step runs in a thread team (one OpenMP region): more than one thread, not already
  // inside a parallel region, every projection with an in-team entry (and the raw entries on),
  // and every layer's projections of one width (the team's shared buffers are sized once).
  bool team_applies() const {
    if (!thread_team || !raw_entries || layers.empty() || at::get_num_threads() < 2 || omp_in_parallel()) return false;
    const PlanLayer& first = layers.front();
    for (const PlanLayer& l : layers) {
      for (auto [p, q] : {std::pair{&l.qkv, &first.qkv}, std::pair{&l.o, &first.o}, std::pair{&l.gate_up, &first.gate_up},
                          std::pair{&l.down, &first.down}}) {
        if (!p->weight.defined() || (p->bits > 0 ? p->calls.woq_part == nullptr : p->calls.dense_part == nullptr)) return false;
        if (p->out_features() != q->out_features()) return false;
      }
    }
    return true;
  }

  Tensor run(Workspace& ws, const Tensor& input_ids, const Tensor& positions, const std::vector<Tensor>& k_layers,
             const std::vector<Tensor>& v_layers, const Tensor& new_slots, const std::vector<Tensor>& slots,
             const std::vector<Tensor>& kv_lens, const std::optional<Tensor>& embedded,
             const std::vector<Tensor>& k_scales, const std::vector<Tensor>& v_scales) const {
    TORCH_CHECK(k_layers.size() == layers.size() && v_layers.size() == layers.size(), "one KV layer per layer");
    TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == layers.size()),
                "k_scales and v_scales: one a layer each (an int8 pool), or none");
    const bool int8_kv = !k_scales.empty();
    // layer i's scales, or null (K/V in the model's dtype)
    auto k_scale = [&](size_t i) { return int8_kv ? &k_scales[i] : nullptr; };
    auto v_scale = [&](size_t i) { return int8_kv ? &v_scales[i] : nullptr; };
    TORCH_CHECK(slots.size() == kv_lens.size(), "one kv_lens per slot table");
    for (const PlanLayer& l : layers) {
      TORCH_CHECK(l.window_id >= 0 && l.window_id < static_cast<int64_t>(slots.size()), "no slot table ", l.window_id);
    }
    TORCH_CHECK(input_ids.dim() == 1 && positions.dim() == 1 && positions.size(0) == input_ids.size(0) &&
                    input_ids.size(0) >= 1,
                "input_ids and positions must be [B] each (B >= 1), one position a row; got ", input_ids.sizes(),
                " and ", positions.sizes());
    // CausalLM.forward: embedding (scaled), the rotary tables' rows for these positions.
    if (embedded) {
      TORCH_CHECK(embedded->dim() == 2 && embedded->size(0) == input_ids.size(0) &&
                      embedded->size(1) == embed.size(1) && embedded->scalar_type() == embed.scalar_type(),
                  "embedded must be [B, hidden] in the model's dtype, one row an id; got ", embedded->sizes());
    } else {
      TORCH_CHECK(embed.size(0) > 0, "this plan's table is quantized: forward() needs the embedded rows");
    }
    Tensor x0 = embedded ? embedded->contiguous() : at::embedding(embed, input_ids);
    if (embed_scale) x0 = at::mul(x0, *embed_scale);
    const auto dtype = x0.scalar_type();
    rope_rows(ws, positions, dtype);
    const int64_t b = x0.size(0), hidden = x0.size(1);
    const auto options = x0.options();
    at::internal::lazy_init_num_threads();  // (this thread's OpenMP thread count, as at::parallel_for sets it)
    const bool in_team = team_applies();
    // Buffers: the attention's output and, in a team, the projections' outputs (shared by the
    // team: each thread writes its share); per thread the residual stream (each thread keeps its
    // own copy and does the small row-wise work itself, which costs less than a barrier), the
    // norm that feeds a projection, a norm of a projection's output (sandwich), the gating.
    const int64_t copies = in_team ? omp_get_max_threads() : 1;
    ws.x.resize(copies);
    ws.h.resize(copies);
    ws.normed.resize(copies);
    ws.act.resize(copies);
    for (int64_t t = 0; t < copies; ++t) {
      Workspace::get(ws.x[t], b, hidden, options).copy_(x0);
      Workspace::get(ws.h[t], b, hidden, options);
      Workspace::get(ws.normed[t], b, hidden, options);
    }
    Workspace::get(ws.attn, b, n_heads * head_dim, options);
    std::vector<Tensor> lens(kv_lens.size());
    // the checks of the attention's and the head prep's inputs (prepare_share's on raw storage),
    // and in a team the attention's work items once per slot table, before any layer runs
    for (size_t w = 0; w < kv_lens.size(); ++w) lens[w] = kv_lens[w].contiguous();
    ws.attend.resize(slots.size());
    std::vector<int64_t> planned(slots.size(), -1);  // kv heads each table's work was made for
    int64_t num_slots = std::numeric_limits<int64_t>::max();  // the smallest layer's pool
    for (size_t i = 0; i < layers.size(); ++i) {
      const PlanLayer& l = layers[i];
      const int64_t w = l.window_id;
      check_cache_and_tables(k_layers[i], v_layers[i], dtype, b, n_heads, head_dim, slots[w], lens[w], k_scale(i),
                             v_scale(i));
      const int64_t hkv = k_layers[i].size(1), width = (n_heads + 2 * hkv) * head_dim;
      TORCH_CHECK(l.qkv.out_features() == width, "layer ", i, "'s qkv_proj gives ", l.qkv.out_features(),
                  " features, not (heads + 2 kv heads) * head_dim = ", width);
      TORCH_CHECK(ws.cos[l.rope_id].size(0) == b && ws.cos[l.rope_id].size(1) == head_dim, "rotary table ", l.rope_id,
                  "'s rows must be [B, head_dim]");
      if (in_team && planned[w] < 0) {
        plan_attention(ws.attend[w], b, n_heads, hkv, head_dim, lens[w].const_data_ptr<int64_t>(), slots[w].size(1),
                       copies, attends_whole_rows(k_scale(i) != nullptr, head_dim));
        planned[w] = hkv;
      }
      TORCH_CHECK(!in_team || planned[w] == hkv, "layers of one slot table must have one number of kv heads");
      num_slots = std::min(num_slots, k_layers[i].size(0));
    }
    check_new_slots(new_slots, b, num_slots);
    if (in_team) {
      const PlanLayer& l = layers.front();
      Workspace::get(ws.qkv, b, l.qkv.out_features(), options);
      Workspace::get(ws.o, b, l.o.out_features(), options);
      Workspace::get(ws.gate_up, b, l.gate_up.out_features(), options);
      Workspace::get(ws.down, b, l.down.out_features(), options);
      for (int64_t t = 0; t < copies; ++t) Workspace::get(ws.act[t], b, l.gate_up.out_features() / 2, options);
    }
    TeamState state;
    Tensor out_delta;   // the last layer's output, not yet added to the residual (first thread's)
    auto body = [&](const Team t) {
      Tensor& x = ws.x[t.part];
      Tensor& h = ws.h[t.part];
      Tensor& normed = ws.normed[t.part];
      Tensor delta;  // the previous layer's output, not yet added to x
      for (size_t i = 0; i < layers.size(); ++i) {
        const PlanLayer& l = layers[i];
        // DecoderLayer.forward, step by step.
        t.run([&] {
          if (delta.defined()) {
            add_rms_norm_into(x, delta, l.input_norm, eps, h);
          } else {
            rms_norm_into(x, l.input_norm, eps, h);
          }
        });
        Tensor qkv;
        t.run([&] { qkv = project(l.qkv, h, ws.qkv, t); });
        t.barrier();
        // bias, q / k norm, rotary, q's pre-scale and the K/V store: this thread's share of the heads
        t.run([&] { prepare_share(l, qkv, ws, k_layers[i], v_layers[i], new_slots, t, k_scale(i), v_scale(i)); });
        if (!t.team) {
          t.run([&] {
            decode_attention_into(qkv.view({b, -1, head_dim}).narrow(1, 0, n_heads), k_layers[i], v_layers[i],
                                  slots[l.window_id], kv_lens[l.window_id], ws.attn, k_scale(i), v_scale(i));
          });
        } else {  // the attention's items, then the merges of split rows' chunks, split by part
          AttendWork& work = ws.attend[l.window_id];
          t.barrier();
          for (bool merges : {false, true}) {
            if (merges && work.merges.empty()) break;
            t.run([&] {
              const AttendArgs a = attend_args(qkv.const_data_ptr(), qkv.size(1), head_dim, k_layers[i], v_layers[i],
                                               slots[l.window_id], lens[l.window_id], ws.attn, k_scale(i), v_scale(i));
              int64_t bad = 0;
              if (!attend_share(dtype, a, work, merges, t.part, t.parts, &bad)) {
                state.bad_slot.store(bad);
                state.bad.store(true);
              }
            });
            t.barrier();
          }
        }
        Tensor o;
        t.run([&] { o = project(l.o, ws.attn, ws.o, t); });
        t.barrier();
        t.run([&] {
          if (l.pre_feedforward_norm) {
            rms_norm_into(o, l.post_attention_norm, eps, normed);
            add_rms_norm_into(x, normed, *l.pre_feedforward_norm, eps, h);
          } else {
            add_rms_norm_into(x, o, l.post_attention_norm, eps, h);
          }
        });
        Tensor gate_up;
        t.run([&] { gate_up = project(l.gate_up, h, ws.gate_up, t); });
        t.barrier();
        Tensor m;
        t.run([&] {
          Tensor& act = Workspace::get(ws.act[t.part], b, gate_up.size(1) / 2, options);
          m = project(l.down, l.gelu ? gelu_tanh_mul_into(gate_up, act) : silu_mul_into(gate_up, act), ws.down, t);
        });
        t.barrier();
        t.run([&] {
          if (l.post_feedforward_norm) m = rms_norm_into(m, *l.post_feedforward_norm, eps, normed);
          delta = m;
        });
      }
      if (t.lead()) out_delta = delta;
    };
    if (in_team) {
#pragma omp parallel
      {
        const int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
        const Team t{part, parts, true, &state};
        if (parts <= copies) {
          body(t);
        } else if (t.lead()) {  // (cannot happen: a team has at most omp_get_max_threads())
          t.run([&] { TORCH_CHECK(false, "the decode plan's team has ", parts, " threads, buffers for ", copies); });
        }
      }
      if (state.error) std::rethrow_exception(state.error);
      TORCH_CHECK(!state.bad.load(), "slot ", state.bad_slot.load(), " outside the pool's ", k_layers[0].size(0), " slots");
    } else {
      body(Team{});
    }
    Tensor& x = ws.x[0];
    return out_delta.defined() ? add_rms_norm_(x, out_delta, final_norm, eps) : rms_norm(x, final_norm, eps);
  }
};

}  // namespace

void register_decode_plan(torch::Library& m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<Tensor, std::optional<Tensor>, Tensor, double, int64_t, int64_t, std::vector<Tensor>,
                       std::vector<Tensor>>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("set_projection", &DecodePlan::set_projection)
      .def("use_raw_entries", &DecodePlan::use_raw_entries)
      .def("use_thread_team", &DecodePlan::use_thread_team)
      .def("forward", &DecodePlan::forward);
}

}  // namespace sgrt_layer
