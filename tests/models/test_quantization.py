"""Weight-only int8 / int4 (sgrt/models/quant.py) and raw Q4_1 blocks (sgrt/models/gguf_raw.py):
exactness of the int4 weights against the GGUF file, the int8 round-trip bound, and accuracy
against bfloat16, teacher-forced over a 200-token text."""
from __future__ import annotations

import pytest
import torch

from sgrt.errors import InvalidRequest
from sgrt.models import LoadedModel, load_model
from sgrt.models import gguf_raw, loader, packed, quant

MODEL = "smollm2-135m-instruct"

# Written for this test (not tuned on the models: it was fixed before the numbers below were
# measured); 227 tokens, the first 200 used.
TEXT = (
    "The lighthouse keeper had lived on the island for nearly thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick, and polished the great lens until it shone like a second moon. "
    "Ships passing in the night never saw him, but they trusted the steady beam that swept across the "
    "water every twelve seconds. In winter the storms came from the north, and waves broke over the "
    "rocks with a sound like distant thunder. He kept a journal of the weather, the birds, and the "
    "boats, writing in a small careful hand. One spring morning a young woman arrived on the supply "
    "boat with a letter from the harbour office. The light was to be automated, the letter said, and "
    "his service would no longer be required after the summer. He read it twice, folded it, and put "
    "the kettle on. Then he sat by the window and watched the gulls for a long time, thinking about "
    "the mainland, where he had not set foot since his brother's wedding. When the tea was ready he "
    "poured two cups, one for himself and one for the visitor, and asked her whether she knew how to "
    "read the barometer."
)
N_TOKENS = 200

# Thresholds, from measurements on this text (2-core AVX512-BF16 CPU, torch 2.13):
#   float32 vs bfloat16 (the noise floor: same weights, other rounding): top-1 97.0%, KL 0.00081
#   native kernel (sgrt/kernels/woq.py), int8 LM head in both modes:
#     int4 (Q4_1 codes, d and m exactly as in the file):              top-1 99.5%, KL 0.00062
#     int8 (groups of 32, scale and offset, quantized at load):        top-1 97.5%, KL 0.00154
#   torch's kernels (CUDA, CPUs without AVX512-BF16), int8 LM head:
#     int4 (Q4_1 codes, scale and zero rounded to bfloat16):            top-1 96.0%, KL 0.0023
#     int8 (per channel):                                              top-1 96.0%, KL 0.0054
#     (earlier, before the fused layer operators moved bfloat16 roundings: 97.0% / 94.0%)
# Issue 10 asks for >= 97% (int8) and >= 90% (int4): the native path meets both, and the int4 bound
# below is stricter. torch's per-channel int8 misses 97%: the default model's weights *are* 4-bit
# Q4_1 groups, which bfloat16 holds almost exactly while a per-channel grid re-rounds them (a
# step of max|row| / 127); its bounds keep 2 tokens of margin. KL bounds are ~2x the measurements,
# so a real regression (an int4 LM head quantized at load: 84%, KL 0.06) fails them.
MIN_TOP1 = {"int8": 0.97, "int4": 0.95}
MAX_MEAN_KL = {"int8": 0.004, "int4": 0.002}
MIN_TOP1_TORCH = {"int8": 0.93, "int4": 0.95}
MAX_MEAN_KL_TORCH = {"int8": 0.01, "int4": 0.005}

NATIVE = quant.native_kernel_available()


def woq_isa() -> str | None:
    from sgrt.kernels import woq

    return woq.isa()
needs_native = pytest.mark.skipif(not NATIVE, reason="the native kernel needs an AVX512-BF16 CPU and a compiler")


@pytest.fixture(scope="module")
def bf16_model() -> LoadedModel:
    return load_model(MODEL, dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_reference() -> LoadedModel:
    """The accuracy tests' reference: bfloat16 on plain layers, every projection and the LM head
    one ``F.linear`` (what the thresholds below were measured against). The loaded bfloat16 model
    may run prefill-sized matmuls another way (oneDNN prepacked: bit-identical; on AVX2 CPUs
    ``packed.linear_bf16_via_f32``: the same float32 sums in another order, which moves the
    200-token agreements by a token, within the float32-vs-bfloat16 noise floor)."""
    return load_model(MODEL, dtype="bfloat16", prepack=False)


def _load_quantized(q: str) -> LoadedModel:
    lm = load_model(MODEL, dtype="bfloat16", quantization=q)
    if isinstance(lm.model.embed_tokens, quant.GroupEmbedding):
        # the native kernel: the head holds the file's Q8_0 table, which is also the input
        # embedding, and scores every batch (no float table is kept)
        assert lm.model.embed_tokens.table is lm.model.logits_head
        assert lm.model.logits_head_max_rows == 1 << 62
    else:
        # torch's kernels: score every position with the quantized LM head, as decode batches of up
        # to logits_head_max_rows rows do (past that the model switches to its bfloat16 table)
        assert lm.model.logits_head_max_rows == quant.INT8_HEAD_MAX_ROWS
        lm.model.logits_head_max_rows = N_TOKENS
    return lm


@pytest.fixture(scope="module")
def quantized() -> dict[str, LoadedModel]:
    """int8 and int4 models on the kernels this machine uses (the native one where it builds)."""
    return {q: _load_quantized(q) for q in ("int8", "int4")}


@pytest.fixture(scope="module")
def quantized_torch() -> dict[str, LoadedModel]:
    """int8 and int4 models on torch's packed kernels, the path off the native kernel."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "native_kernel_available", lambda: False)
        return {q: _load_quantized(q) for q in ("int8", "int4")}


@pytest.fixture(scope="module")
def gguf_reader():
    import gguf

    return gguf.GGUFReader(str(loader.default_gguf_path()))


def _logits(lm: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model.forward_simple(ids).float()


def _agreement_and_kl(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || got) over positions, logits ``[T, V]``."""
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).mean().item()
    return top1, kl


# ---- accuracy -----------------------------------------------------------------------------------

def _accuracy(bf16_model, models, loaded_model, title) -> dict[str, tuple[float, float]]:
    ids = torch.tensor(bf16_model.tokenizer.encode(TEXT)[:N_TOKENS])
    assert len(ids) == N_TOKENS
    ref = _logits(bf16_model, ids)
    rows = {"float32": _agreement_and_kl(ref, _logits(loaded_model, ids))}
    for q, lm in models.items():
        rows[q] = _agreement_and_kl(ref, _logits(lm, ids))
    print(f"\nteacher-forced over {N_TOKENS} tokens, against bfloat16 ({title}):")
    for name, (top1, kl) in rows.items():
        print(f"  {name:8s} top-1 agreement {top1:6.1%}  mean KL {kl:.5f}")
    return rows


def test_accuracy_against_bfloat16(bf16_reference, quantized, loaded_model, capsys):
    with capsys.disabled():
        rows = _accuracy(bf16_reference, quantized, loaded_model, "native kernel" if NATIVE else "torch's kernels")
    min_top1, max_kl = (MIN_TOP1, MAX_MEAN_KL) if NATIVE else (MIN_TOP1_TORCH, MAX_MEAN_KL_TORCH)
    for q in ("int8", "int4"):
        top1, kl = rows[q]
        assert top1 >= min_top1[q], f"{q}: top-1 agreement {top1:.1%} < {min_top1[q]:.0%}"
        assert kl <= max_kl[q], f"{q}: mean KL {kl:.5f} > {max_kl[q]}"


# int4 with int8 activations (int4_activations="int8", the AVX2 kernel's opt-in: llama.cpp's Q8
# blocks), measured on this text against the same bfloat16 reference (2-core AVX2 EPYC): top-1 94.0%,
# KL 0.0037, against 97.5% / 0.0016 with the default ~16-bit activations on that machine. Bounds:
# ~3 tokens of margin, ~2x the KL.
INT8_ACTIVATIONS_MIN_TOP1, INT8_ACTIVATIONS_MAX_KL = 0.925, 0.008


@pytest.mark.skipif(not NATIVE or woq_isa() != "avx2", reason="int8 activations are the AVX2 kernel's option")
def test_int8_activations_accuracy(bf16_reference):
    lm = load_model(MODEL, dtype="bfloat16", quantization="int4", int4_activations="int8")
    lm.model.logits_head_max_rows = N_TOKENS
    assert lm.model.layers[0].qkv_proj.activations == "int8"
    assert lm.model.logits_head.activations == "int16"  # (the int8 LM head keeps its default)
    ids = torch.tensor(bf16_reference.tokenizer.encode(TEXT)[:N_TOKENS])
    top1, kl = _agreement_and_kl(_logits(bf16_reference, ids), _logits(lm, ids))
    print(f"\nint4, int8 activations: top-1 agreement {top1:6.1%}  mean KL {kl:.5f}")
    assert top1 >= INT8_ACTIVATIONS_MIN_TOP1 and kl <= INT8_ACTIVATIONS_MAX_KL, (top1, kl)


@pytest.mark.skipif(not NATIVE or woq_isa() != "avx2", reason="int8 activations are the AVX2 kernel's option")
def test_int8_prefill_activations_follow_the_row_count(bf16_reference, quantized):
    """``int4_activations="int8-prefill"`` end to end: a prefill of 200 tokens gets int8's logits
    bit for bit, a one-token call the default's (decode keeps 16 bits)."""
    int8 = load_model(MODEL, dtype="bfloat16", quantization="int4", int4_activations="int8")
    mixed = load_model(MODEL, dtype="bfloat16", quantization="int4", int4_activations="int8-prefill")
    for lm in (int8, mixed):
        lm.model.logits_head_max_rows = N_TOKENS
    ids = torch.tensor(bf16_reference.tokenizer.encode(TEXT)[:N_TOKENS])
    assert torch.equal(_logits(mixed, ids), _logits(int8, ids))
    assert torch.equal(_logits(mixed, ids[:1]), _logits(quantized["int4"], ids[:1]))
    assert not torch.equal(_logits(int8, ids[:1]), _logits(quantized["int4"], ids[:1]))


def test_int4_activations_errors():
    """Checked before anything loads (load_model, Engine): an unknown name, int8 activations
    without int4."""
    from sgrt.engine import Engine

    for load in (load_model, Engine):
        with pytest.raises(InvalidRequest, match="int4_activations must be one of int16, int8, int8-prefill") as e:
            load(MODEL, dtype="bfloat16", quantization="int4", int4_activations="fp8")
        assert e.value.field == "int4_activations"
        with pytest.raises(InvalidRequest, match="applies to quantization='int4'") as e:
            load(MODEL, dtype="bfloat16", quantization="int8", int4_activations="int8-prefill")
        assert e.value.field == "int4_activations"


@needs_native
def test_accuracy_on_torchs_kernels(bf16_reference, quantized_torch, loaded_model, capsys):
    """The fallback path, where the native kernel does not build."""
    for lm in quantized_torch.values():
        assert isinstance(lm.model.layers[0].qkv_proj, (quant.Int8Linear, quant.Int4Linear))
    with capsys.disabled():
        rows = _accuracy(bf16_reference, quantized_torch, loaded_model, "torch's kernels")
    for q in ("int8", "int4"):
        top1, kl = rows[q]
        assert top1 >= MIN_TOP1_TORCH[q], f"{q}: top-1 agreement {top1:.1%} < {MIN_TOP1_TORCH[q]:.0%}"
        assert kl <= MAX_MEAN_KL_TORCH[q], f"{q}: mean KL {kl:.5f} > {MAX_MEAN_KL_TORCH[q]}"


def test_quantized_engine_answers(quantized):
    from sgrt.engine import Engine, SamplingParams

    for q, lm in quantized.items():
        with Engine(model=lm, max_total_tokens=256) as eng:
            res = eng.generate("The capital of France is", SamplingParams(max_tokens=3))
        assert res.text.startswith(" Paris"), (q, res.text)


# ---- int4: exactly the file's Q4_1 weights --------------------------------------------------------

_FUSED = {  # one fused projection with rotary-permuted rows (q, k) and two plain ones
    "layers.0.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "layers.29.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "layers.29.down_proj": ["mlp.down_proj"],
}


def _file_weights(reader, layer: int, parts: list[str]) -> torch.Tensor:
    """``gguf.quants.dequantize`` of the GGUF tensors (float32, q/k rows unpermuted), stacked."""
    import gguf

    config, _ = loader.gguf_config(reader, MODEL)
    by_name = {loader.hf_name(t.name): t for t in reader.tensors}
    out = []
    for part in parts:
        t = by_name[f"model.layers.{layer}.{part}.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        if part == "self_attn.q_proj":
            w = loader.unpermute_rotary(w, config.num_attention_heads)
        elif part == "self_attn.k_proj":
            w = loader.unpermute_rotary(w, config.num_key_value_heads)
        out.append(w)
    return torch.cat(out)


@pytest.fixture(scope="module")
def raw_blocks(gguf_reader) -> dict[str, gguf_raw.Q4_1Weight]:
    """The Q4_1 blocks of the projections in ``_FUSED`` (gguf_raw.unpack_q4_1 of the file's bytes,
    q / k rows unpermuted), fused like the model's layers."""
    config, _ = loader.gguf_config(gguf_reader, MODEL)
    by_name = {loader.hf_name(t.name): t for t in gguf_reader.tensors}
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    out = {}
    for key, parts in _FUSED.items():
        ws = []
        for part in parts:
            t = by_name[f"model.layers.{key.split('.')[1]}.{part}.weight"]
            cols, rows = (int(x) for x in t.shape)
            w = gguf_raw.unpack_q4_1(t.data, rows, cols)
            if part in heads:
                w = gguf_raw.Q4_1Weight(*(loader.unpermute_rotary(x, heads[part]) for x in (w.codes, w.d, w.m)))
            ws.append(w)
        out[key] = gguf_raw.Q4_1Weight.cat(ws)
    return out


def test_int4_mapping_of_q4_1_is_exact(gguf_reader, raw_blocks):
    """Q4_1 (d, m) -> the kernel's (scale, zero), packed and read back *through the kernel* with
    float32 scales: bit-identical to gguf.quants.dequantize."""
    for key, parts in _FUSED.items():
        b = raw_blocks[key]
        expected = _file_weights(gguf_reader, int(key.split(".")[1]), parts)
        assert torch.equal(b.dequantize(), expected), key
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(b.codes.to(torch.int32), 2)
        sz32 = quant.q4_1_scales_and_zeros(b.d, b.m, torch.float32)
        eye = torch.eye(b.shape[1])
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, quant.INT4_GROUP_SIZE, sz32)
        assert torch.equal(w_t.t(), expected), key


def test_int4_model_uses_the_files_codes(quantized, quantized_torch, gguf_reader, raw_blocks):
    """The loaded int4 models. Native kernel: codes, d and m exactly the file's, so the weights
    are bit-identical to gguf.quants.dequantize. torch's kernel: codes the file's; scale and
    zero the file's d and m + 8 d rounded to bfloat16 (what the fast kernel takes), so every
    weight is within 2**-8 * (8 |d| + |m + 8 d|) of the file's."""
    from sgrt.kernels import woq

    models = [quantized_torch["int4"].model] + ([quantized["int4"].model] if NATIVE else [])
    for model in models:
        for key, parts in _FUSED.items():
            _, layer, proj = key.split(".")
            mod = getattr(model.layers[int(layer)], proj)
            b = raw_blocks[key]
            expected = _file_weights(gguf_reader, int(layer), parts)
            if isinstance(mod, quant.GroupLinear):
                assert mod.bits == 4 and mod.group_size == quant.INT4_GROUP_SIZE
                assert torch.equal(woq.unpack(mod.packed, *b.shape, 4), b.codes), key
                scales, offsets = mod.group_params()
                assert torch.equal(scales, b.d) and torch.equal(offsets, b.m), key
                assert torch.equal(mod.dequantize(), expected), key
                continue
            assert isinstance(mod, quant.Int4Linear)
            got = mod.dequantize()  # (q - 8) * scale + zero, float32, through the kernel
            sz = mod.scales_and_zeros.float()  # [G, N, 2]
            scale = sz[..., 0].t().repeat_interleave(quant.INT4_GROUP_SIZE, dim=1)
            zero = sz[..., 1].t().repeat_interleave(quant.INT4_GROUP_SIZE, dim=1)
            assert torch.equal(torch.round((got - zero) / scale) + 8, b.codes.float()), key
            assert torch.equal(sz, quant.q4_1_scales_and_zeros(b.d, b.m).float()), key
            bound = 2.0 ** -8 * (8 * scale.abs() + zero.abs()) * 1.01
            assert ((got - expected).abs() <= bound).all(), key


def test_q8_0_table_loads_exactly_as_the_head_and_the_embedding(gguf_reader, quantized):
    """The default model's Q8_0 tensor (the tied embedding) read as int8 groups (codes q + 128,
    offset -128 d): the file's weights bit for bit; the int4 model's LM head is built from them as
    they are (the AVX2 kernel: its compact stream), and its input embedding reads the same table."""
    import gguf

    from sgrt.kernels import woq

    t = next(t for t in gguf_reader.tensors if t.name == "token_embd.weight")
    cols, rows = (int(x) for x in t.shape)
    a = gguf_raw.unpack_q8_0(t.data, rows, cols)
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(a.shape).float()
    assert a.c == 128 and torch.equal(a.dequantize(), ref)
    if NATIVE:
        model = quantized["int4"].model
        head = model.logits_head
        assert isinstance(head, quant.GroupLinear) and head.bits == 8
        assert torch.equal(head.dequantize(), ref)
        if woq.isa() == "avx2":
            assert head.stream_bits == woq.stream_bits(8, 128)
            assert head.packed.numel() == ref.numel() * 17 // 16  # 1 + 2/32 bytes a weight
        ids = torch.tensor([[1, 2, 3], [49151, 0, 1]])
        assert torch.equal(model.embed_tokens(ids), ref[ids].bfloat16())


# ---- int8 and int4 at load --------------------------------------------------------------------------

def test_int8_round_trip_error_is_at_most_half_a_step(loaded_model):
    model = loaded_model.model
    for w in (model.layers[0].qkv_proj.weight, model.layers[17].down_proj.weight, model.embed_tokens.weight):
        q, scale = quant.quantize_int8(w)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
        err = (q.float() * scale.float().unsqueeze(1) - w).abs()
        half_step = scale.float().unsqueeze(1) / 2
        assert (err <= half_step * (1 + 1e-6)).all()
        # relative to the row's largest weight: at most 1/254 (plus bfloat16's rounding of scale)
        assert (err.amax(1) <= w.abs().amax(1) / 254 * (1 + 2.0 ** -8) + 1e-12).all()


@pytest.mark.parametrize("cls", [quant.Int8Linear, quant.Int4Linear])
def test_quantized_linear_matches_its_dequantized_weight(cls):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    mod = cls.from_float(w)
    w_deq = mod.dequantize()
    if cls is quant.Int4Linear:  # min/max per group of 32: error at most half a step
        g = w.view(96, 4, 32)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, dim=1)
        assert ((w_deq - w).abs() <= step * (0.5 + 2.0 ** -7) + 1e-7).all()
    for x in (torch.randn(3, 128), torch.randn(2, 5, 128).bfloat16()):  # any dtype and rank
        y = mod(x)
        assert y.shape == (*x.shape[:-1], 96) and y.dtype == x.dtype
        ref = x.bfloat16().float() @ w_deq.t()
        assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("cls", [quant.Int8Linear, quant.Int4Linear])
def test_prefill_sized_inputs_take_the_dense_path_with_the_same_weights(cls, monkeypatch):
    """From DENSE_MIN_ROWS rows the layer multiplies by its weight dequantized to bfloat16
    (for int4: unpacked from the CPU kernel's layout) instead of calling the packed kernel."""
    torch.manual_seed(1)
    w = torch.randn(128, 192) * 0.05
    mod = cls.from_float(w)
    # int4's dense path needs torch's CPU packing layout to be the one unpack_int4_cpu inverts
    # (checked at load); where it is another (this torch on a CPU without AVX-512), prefill
    # chunks keep the kernel, with the same weights.
    dense = cls is quant.Int8Linear or mod._unpackable
    if cls is quant.Int4Linear and dense:
        codes, _ = quant.quantize_int4(w)
        assert torch.equal(quant.unpack_int4_cpu(mod.packed, 128, 192), codes)
    calls = []
    kernel = torch.ops.aten._weight_int8pack_mm if cls is quant.Int8Linear else mod._mm
    x = torch.randn(quant.DENSE_MIN_ROWS + 5, 192).bfloat16()
    ref = x.float() @ mod.dequantize().t()
    if cls is quant.Int8Linear:
        monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(1) or kernel(*a))
    else:
        mod._mm = lambda *a: calls.append(1) or kernel(*a)
    y = mod(x)
    assert bool(calls) is not dense  # the dense path where it is known, else the kernel
    assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    mod(x[:4])
    assert calls  # decode-sized inputs keep the kernel


@pytest.mark.parametrize("native", [True, False])
def test_tiny_model_quantizes_at_load_and_keeps_unsupported_shapes_in_float(tmp_path, monkeypatch, native):
    """The HF-folder path (no blocks to take): every projection quantized at load, except one whose
    width no kernel takes (kept in float); the input embedding stays a float table (an HF
    checkpoint's values, which the int8 head only approximates)."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    if native and not NATIVE:
        pytest.skip("the native kernel did not build here")
    if not native:
        monkeypatch.setattr(quant, "native_kernel_available", lambda: False)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=104, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, initializer_range=0.1)
    HFLlama(cfg).save_pretrained(tmp_path / "tiny")
    load_model(MODEL, dtype="float32").tokenizer.hf.save_pretrained(tmp_path / "tiny")
    ref = load_model(str(tmp_path / "tiny"), dtype="float32", cache_dir=tmp_path / "cache")
    ids = torch.randint(0, 256, (12,))
    expected = ref.model.forward_simple(ids)
    for method in ("int8", "int4"):
        lm = load_model(str(tmp_path / "tiny"), dtype="bfloat16", quantization=method, cache_dir=tmp_path / "cache",
                        prepack=False)  # (float layers stay nn.Linear)
        model = lm.model
        assert model.quantization == method
        # down_proj (in_features 104) fits no kernel (torch's int8: in % 16, int4 and the native one: in % 32).
        assert lm.counts == {"blocks": 0, "quantized": 2 * 3 + 1, "int8_wide": 0, "float": 2}, lm.counts
        assert type(model.layers[0].down_proj) is torch.nn.Linear
        assert type(model.embed_tokens) is torch.nn.Embedding
        if native:
            assert isinstance(model.layers[0].gate_up_proj, quant.GroupLinear)
            assert model.layers[0].gate_up_proj.bits == (8 if method == "int8" else 4)
            assert isinstance(model.logits_head, quant.GroupLinear) and model.logits_head.bits == 8
        else:
            assert isinstance(model.layers[0].gate_up_proj, quant.Int8Linear if method == "int8" else quant.Int4Linear)
            assert isinstance(model.logits_head, quant.Int8Linear)  # int8 head in both modes
        rel = ((model.forward_simple(ids) - expected).norm() / expected.norm()).item()
        print(f"{method}: relative logit error {rel:.4f}")
        assert rel < MAX_TINY_REL_ERR[method]
    assert not quant.Int8Linear.supports(64, 24, torch.device("cpu"))
    assert not quant.Int4Linear.supports(24, 64, torch.device("cpu"))


# Measured on the tiny random model (HF init, std 0.1): int8 0.017-0.019, int4 0.23 (native and
# torch's kernels); ~1.5x that, where a wrong layout or scale gives ~1.
MAX_TINY_REL_ERR = {"int8": 0.03, "int4": 0.35}


def test_quantization_name_is_checked():
    assert quant.parse_quantization(None) == "none"
    assert quant.parse_quantization("INT4") == "int4"
    with pytest.raises(InvalidRequest) as e:
        load_model(MODEL, quantization="int3")
    assert e.value.field == "quantization" and "int3" in str(e.value)


def test_weight_memory(bf16_model, quantized):
    model = bf16_model.model
    # The tied LM head (sgrt/models/packed.py): the dense kernel on the embedding table itself (no
    # copy; parameters() counts the shared table once), else a oneDNN-prepacked copy of the table,
    # else none. Where oneDNN prepacks bfloat16, every DenseLinear also holds a prepacked copy of
    # its weight (``above``): the same number of bytes again, left out here.
    head = model.logits_head
    copies = [m.above for m in model.modules() if isinstance(m, packed.DenseLinear) and m.above is not None]
    if isinstance(head, packed.PackedLinear):
        copies.append(head)
        assert head.packed.numel() == model.embed_tokens.weight.numel()
    elif head is not None:
        assert isinstance(head, packed.DenseLinear) and head.weight is model.embed_tokens.weight
    for copy in copies:
        assert copy.packed.numel() == copy.out_features * copy.in_features and copy.packed.element_size() == 2
    copies_mb = sum(c.packed.numel() * c.packed.element_size() for c in copies) / 1e6
    mb = {"bf16": quant.weight_bytes(model) / 1e6 - copies_mb}
    mb.update({q: quant.weight_bytes(lm.model) / 1e6 for q, lm in quantized.items()})
    # 134.5M parameters: bf16 2 bytes each. Native kernel: int4 0.625 bytes a weight, int8 1.125 (a
    # float16 scale and offset per 32), the Q8_0 head 1.0625 and no float input table beside it.
    assert 265 < mb["bf16"] < 275
    assert mb["int4"] < 0.6 * mb["bf16"] and mb["int8"] < 0.8 * mb["bf16"]
    if NATIVE:
        assert 88 < mb["int4"] < 98 and mb["int8"] < 160, mb


# ---- the native kernel's group-wise layers ---------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_groups_error_is_half_a_step(bits):
    torch.manual_seed(2)
    w = torch.randn(64, 96) * 0.05
    codes, scale, offset = quant.quantize_groups(w, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2 ** bits - 1
    assert scale.dtype == offset.dtype == torch.float16 and scale.shape == (64, 3)
    deq = (codes.float().view(64, 3, 32) * scale.float()[..., None] + offset.float()[..., None]).view(64, 96)
    g = w.view(64, 3, 32)
    step = ((g.amax(-1) - g.amin(-1)) / (2 ** bits - 1)).repeat_interleave(32, dim=1)
    # half a step, plus float16's rounding of the step and the offset (2**-11 relative)
    slack = 2.0 ** -10 * (step * (2 ** bits - 1) + w.abs().amax())
    assert ((deq - w).abs() <= step / 2 + slack).all()
    with pytest.raises(ValueError, match="float16"):
        quant.quantize_groups(torch.full((16, 32), 1e6), bits)


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_group_linear_matches_its_dequantized_weight_at_any_batch(bits):
    torch.manual_seed(3)
    w = torch.randn(96, 128) * 0.05
    mod = quant.GroupLinear.from_float(w, bits)
    w_deq = mod.dequantize()
    calls = []
    real = mod._linear
    mod._linear = lambda *a: calls.append(1) or real(*a)
    inputs = (torch.randn(3, 128), torch.randn(2, 5, 128).bfloat16(), torch.randn(quant.DENSE_MIN_ROWS + 5, 128))
    for x in inputs:  # any dtype and rank; prefill-sized inputs use the kernel too (no dense path)
        y = mod(x)
        assert y.shape == (*x.shape[:-1], 96) and y.dtype == x.dtype
        ref = x.bfloat16().float() @ w_deq.t()
        assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert len(calls) == len(inputs)
