"""Tests of the weight store path (sgrt/models/weight_files.py, weight_packer.py, weight_store.py,
assemble.py): every GGML type read into the kernels' form exactly (or within its documented
rounding), chunked packing byte-identical to packing a tensor whole, the store mapped rather than
copied, and a load's peak memory bounded by the file's size, measured in a process of its own."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.model_files import Shape, Types, write_gguf
from sgrt.models import gguf_raw, load_model, weight_packer
from sgrt.models.quant import GroupLinear, native_kernel_available

ROOT = Path(__file__).resolve().parents[2]
NATIVE = native_kernel_available()
needs_native = pytest.mark.skipif(not NATIVE, reason="the native kernel did not build here")
needs_avx2 = pytest.mark.skipif(not NATIVE or __import__("sgrt.kernels.woq").kernels.woq.isa() != "avx2",
                                reason="the AVX2 library is not loaded here")

# Every type a role: q / k / v are three block types (a widened int4 projection), o_proj Q4_0,
# gate / up the asymmetric 5-bit types, down_proj Q6_K (no group form: re-quantized).
ALL_TYPES = Types("Q4_1", {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0",
                           "ffn_gate": "Q5_1", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"})
TINY = Shape("llama", 2, 256, 512, 4, 2, context=512)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-all-types.gguf", TINY, ALL_TYPES)


def _read_file(path: Path, groups: bool) -> dict[str, torch.Tensor]:
    """A GGUF's float32 weights by canonical name, q / k rows unpermuted: gguf's dequantization,
    or (``groups``) that of the file's blocks in the kernels' group form (:data:`gguf_raw.
    BLOCK_READERS`), where they have one."""
    import gguf

    from sgrt.models.checkpoint import unpermute_rotary
    from sgrt.models.registry import family_for_gguf

    family = family_for_gguf("llama")
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        reader = gguf_raw.BLOCK_READERS.get(t.tensor_type.name)
        if groups and reader is not None:
            cols, rows = (int(x) for x in t.shape)
            w = reader.unpack(t.data, rows, cols).dequantize()
        else:
            w = torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
        name = family.gguf_hf_name(t.name).removeprefix("model.")
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rotary(w, TINY.heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rotary(w, TINY.kv_heads)
        out[name] = w
    return out


@pytest.fixture(scope="module")
def file_weights(tiny_gguf) -> dict[str, torch.Tensor]:
    return _read_file(tiny_gguf, groups=False)


@pytest.fixture(scope="module")
def group_weights(tiny_gguf) -> dict[str, torch.Tensor]:
    return _read_file(tiny_gguf, groups=True)


def test_block_types_read_into_groups_as_the_file_defines(file_weights, group_weights):
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 in group form are the file's weights bit for bit; Q4_K and Q5_K
    within float16's rounding of each group's scale and minimum (2**-11 of each: at most
    2**-11 * (31 |d| + |m|) a weight for 5-bit codes)."""
    exact = ["layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
             "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "embed_tokens.weight"]
    for name in exact:
        assert torch.equal(group_weights[name], file_weights[name]), name
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.up_proj.weight"):
        got, ref = group_weights[name], file_weights[name]
        g = ref.view(ref.shape[0], -1, 32)
        span = (g.amax(-1) - g.amin(-1) + g.abs().amax(-1)).repeat_interleave(32, 1)
        assert ((got - ref).abs() <= 2.0 ** -10 * 2 * span + 1e-7).all(), name
        assert not torch.equal(got, ref)  # (the roundings are there: the comparison is not vacuous)


def _fused(weights: dict[str, torch.Tensor], layer: int, proj: str) -> torch.Tensor:
    return torch.cat([weights[f"layers.{layer}.{p}"] for p in weight_packer.FUSED_PROJECTIONS[proj]])


def test_float32_load_is_the_files_weights(tiny_gguf, file_weights, tmp_path):
    lm = load_model(str(tiny_gguf), dtype="float32", cache_dir=tmp_path, prepack=False)
    for i in range(TINY.layers):
        for proj in weight_packer.FUSED_PROJECTIONS:
            assert torch.equal(getattr(lm.model.layers[i], proj).weight, _fused(file_weights, i, proj)), (i, proj)
    assert torch.equal(lm.model.embed_tokens.weight, file_weights["embed_tokens.weight"])


@needs_native
def test_int4_takes_every_block_type_as_it_is(tiny_gguf, file_weights, group_weights, tmp_path):
    """int4 on a file of every type: o_proj (Q4_0) in 4 bits with the file's codes; q / k / v (Q4_K,
    Q5_0, Q8_0) and gate / up (Q5_1, Q5_K) in int8 with the file's codes (their finer parts keep
    their precision); down_proj (Q6_K, no group form) quantized to int8 groups; the tied head from
    the Q8_0 table, which is also the input embedding (no float table)."""
    from sgrt.models.quant_native import GroupEmbedding

    lm = load_model(str(tiny_gguf), dtype="bfloat16", quantization="int4", cache_dir=tmp_path)
    assert lm.counts == {"blocks": 2 * 3 + 1, "quantized": 2, "int8_wide": 2 * 3, "float": 0}
    for i, layer in enumerate(lm.model.layers):
        assert (layer.qkv_proj.bits, layer.o_proj.bits, layer.gate_up_proj.bits, layer.down_proj.bits) == (8, 4, 8, 8)
        for proj in ("qkv_proj", "o_proj", "gate_up_proj"):
            assert torch.equal(getattr(layer, proj).dequantize(), _fused(group_weights, i, proj)), (i, proj)
        down = file_weights[f"layers.{i}.mlp.down_proj.weight"]
        g = down.view(down.shape[0], -1, 32)
        step = ((g.amax(-1) - g.amin(-1)) / 255).repeat_interleave(32, 1)
        assert ((layer.down_proj.dequantize() - down).abs() <= step / 2 + 2.0 ** -10 * down.abs().amax()).all()
    head = lm.model.logits_head
    assert isinstance(head, GroupLinear) and head.bits == 8
    assert torch.equal(head.dequantize(), file_weights["embed_tokens.weight"])
    assert isinstance(lm.model.embed_tokens, GroupEmbedding) and lm.model.embed_tokens.table is head
    ids = torch.tensor([0, 7, 49151, 7])
    assert torch.equal(lm.model.embed_tokens(ids), file_weights["embed_tokens.weight"][ids].bfloat16())


@needs_native
def test_q4_1_projections_go_to_the_stream_as_the_file_holds_them(tmp_path):
    """A file whose projections are all Q4_1 (q / k rows in llama.cpp's rotary order, fused qkv and
    gate_up) packs straight from its blocks (woq.fuse_q4_1): every projection dequantizes to the
    file's groups, in 4 bits, and the stream is the one the kernel's own preparation makes."""
    from sgrt.kernels import woq

    path = write_gguf(tmp_path / "q4_1.gguf", TINY, Types("Q4_1", {"token_embd": "Q8_0"}))
    groups = _read_file(path, groups=True)
    lm = load_model(str(path), dtype="bfloat16", quantization="int4", cache_dir=tmp_path / "cache")
    for i, layer in enumerate(lm.model.layers):
        for proj in weight_packer.FUSED_PROJECTIONS:
            mod = getattr(layer, proj)
            assert mod.bits == 4 and torch.equal(mod.dequantize(), _fused(groups, i, proj)), (i, proj)
            codes, scales, offsets = mod._unfused()
            again = GroupLinear(woq.unpack(codes, mod.out_features, mod.in_features, 4), scales, offsets, 4)
            assert torch.equal(again.packed, mod.packed), (i, proj)


def _random_blocks(rng: np.random.Generator, n: int, k: int, per: int, size: int) -> np.ndarray:
    """Random GGML blocks ``[n, k / per * size]`` (``per`` weights, ``size`` bytes each) whose two
    leading float16 fields (``d`` and ``m`` / ``dmin``) are finite normal values."""
    blocks = rng.integers(0, 256, (n, k // per * size), dtype=np.uint8)
    halves = rng.standard_normal((n, k // per, 2)).astype(np.float16)
    blocks.reshape(n, k // per, size)[:, :, :4] = halves.view(np.uint8).reshape(n, k // per, 4)
    return blocks


def test_fuse_q4_1_is_fuse_of_the_unpacked_codes():
    """woq.fuse_q4_1 of raw Q4_1 blocks, the AVX2 library's and numpy's, is the stream
    fuse(pack(codes)) makes of the same blocks unpacked, for shapes of one and many 16-row blocks
    and groups; a shape it cannot take raises."""
    from sgrt.kernels import woq

    rng = np.random.default_rng(3)
    for n, k in ((16, 32), (48, 96), (64, 2048)):
        blocks = _random_blocks(rng, n, k, 32, 20)
        w = gguf_raw.unpack_q4_1(blocks, n, k)
        want = woq.fuse(woq.pack(w.codes, 4), w.d, w.m, n, k, 4)
        for native in (False, True):
            assert torch.equal(woq.fuse_q4_1(blocks, n, k, native=native), want), (n, k, native)
            # (the same blocks in another memory order)
            assert torch.equal(woq.fuse_q4_1(np.asfortranarray(blocks), n, k, native=native), want), (n, k, native)
    for native in (False, True):
        with pytest.raises(ValueError, match="multiple of 16"):
            woq.fuse_q4_1(np.zeros((8, 20), np.uint8), 8, 32, native=native)


@needs_avx2
def test_fuse_q4_k_is_fuse_kq4_of_the_unpacked_super_blocks():
    """woq.fuse_q4_k of raw Q4_K super-blocks (the AVX2 library's op) is the
    stream fuse_kq4(pack(codes)) makes of them unpacked (gguf_raw.unpack_q4_k_super), scale and
    min bytes of every value; a shape it cannot take raises."""
    from sgrt.kernels import woq

    rng = np.random.default_rng(4)
    for n, k in ((16, 256), (48, 512), (64, 2048)):
        blocks = _random_blocks(rng, n, k, 256, 144)
        w = gguf_raw.unpack_q4_k_super(blocks, n, k)
        want = woq.fuse_kq4(woq.pack(w.codes, 4), w.d, w.dmin, w.sc, w.mn, n, k)
        assert torch.equal(woq.fuse_q4_k(blocks, n, k), want), (n, k)
        assert torch.equal(woq.fuse_q4_k(np.asfortranarray(blocks), n, k), want), (n, k)
    with pytest.raises(ValueError, match="multiple of 16"):
        woq.fuse_q4_k(np.zeros((8, 144), np.uint8), 8, 256)


@needs_avx2
@pytest.mark.parametrize("kind, size, d_at", [("Q4_K", 144, (0, 2)), ("Q6_K", 210, (208,))])
def test_dequantize_is_ggufs(kind, size, d_at):
    """gguf_raw.dequantize (the AVX2 library's ops) gives gguf's float32
    values bit for bit: every code, scale and min, tiny and large d."""
    import gguf

    rng = np.random.default_rng(6)
    for n, k in ((1, 256), (16, 512), (64, 2048)):
        blocks = rng.integers(0, 256, (n, k // 256 * size), dtype=np.uint8)
        for at in d_at:  # (float16 d / dmin of normal magnitudes, and the extremes)
            d = (rng.standard_normal((n, k // 256)) * 0.01).astype(np.float16)
            d.flat[0], d.flat[-1] = 65504, np.float16(-6e-8)
            blocks.reshape(n, k // 256, size)[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // 256, 2)
        want = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]), np.float32).reshape(n, k)
        got = gguf_raw.dequantize(kind, blocks, n, k)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), (n, k)
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_raw.dequantize(kind, np.zeros((1, size // 2), np.uint8), 1, 128)


def _quantize_fuse_reference(w: torch.Tensor, bits: int) -> torch.Tensor:
    """What woq.quantize_fuse stands for: quantize_groups, then pack and fuse."""
    from sgrt.kernels import woq
    from sgrt.models.quant import quantize_groups

    codes, d, m = quantize_groups(w.float(), bits, 32)
    return woq.fuse(woq.pack(codes, bits), d, m, w.shape[0], w.shape[1], bits, 32)


@needs_avx2
def test_quantize_fuse_is_fuse_of_quantize_groups():
    """woq.quantize_fuse (the AVX2 library's one pass) writes the bytes quantize_groups + pack +
    fuse do, for bfloat16 and float32 rows, 4 and 8 bits: constant groups (scale 0), groups of one
    sign, ties of the rounding, tiny and large values; weights beyond float16 raise as
    quantize_groups does."""
    from sgrt.kernels import woq

    gen = torch.Generator().manual_seed(5)
    for n, k in ((16, 32), (48, 96), (64, 2048)):
        w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 4
        w[0] = 0.5  # (a row of constant groups: scale 0)
        w[1] = w[1].abs() + 3  # (groups of one sign)
        w[2] = torch.arange(k) % 32 / 2.0  # (codes exactly half way between steps)
        w[3] *= 1e-6
        w[4] *= 3000
        for dtype in (torch.bfloat16, torch.float32):
            x = w.to(dtype)
            for bits in (4, 8):
                assert torch.equal(woq.quantize_fuse(x, bits), _quantize_fuse_reference(x, bits)), (n, k, dtype, bits)
    for bad in (float("nan"), float("inf"), 1e6):
        w = torch.randn(32, 64)
        w[17, 40] = bad if bad != 1e6 else bad
        w[17, 41] = -bad if bad == 1e6 else w[17, 41]  # (a range beyond float16's: an overflowing scale)
        for bits in (4, 8):
            with pytest.raises(ValueError, match="float16"):
                _quantize_fuse_reference(w, bits)
            with pytest.raises(ValueError, match="float16"):
                woq.quantize_fuse(w, bits)
    with pytest.raises(ValueError, match="multiple of 16"):
        woq.quantize_fuse(torch.zeros(8, 32), 4)


@needs_avx2
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_float_checkpoint_packs_as_the_reference_quantization(tmp_path, tokenizer, kv_heads):
    """A bfloat16 HF folder's int4 load (projections quantized by woq.quantize_fuse, each part's
    rows where its blocks go; k / v parts of 8 rows go through one stacked piece) holds, in every
    fused projection, the codes, scales and offsets quantize_groups gives the checkpoint's stacked
    weight, and the stream the kernel's own preparation makes of them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgrt.kernels import woq
    from sgrt.models.quant import quantize_groups

    torch.manual_seed(0)
    heads = 8 if kv_heads == 1 else 4
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128)
    folder = tmp_path / "hf"
    ref = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ref.save_pretrained(folder)
    tokenizer.hf.save_pretrained(folder)
    weights = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    lm = load_model(str(folder), dtype="bfloat16", quantization="int4", cache_dir=tmp_path / "cache", prepack=False)
    for i, layer in enumerate(lm.model.layers):
        for proj in weight_packer.FUSED_PROJECTIONS:
            mod = getattr(layer, proj)
            want = quantize_groups(_fused(weights, i, proj).float(), 4, 32)
            packed, scales, offsets = mod._unfused()
            got = (woq.unpack(packed, mod.out_features, mod.in_features, 4), scales, offsets)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (i, proj)
            assert torch.equal(GroupLinear(*want, 4).packed, mod.packed), (i, proj)


@needs_native
def test_chunked_packing_writes_the_bytes_of_whole_tensors(tiny_gguf, tmp_path, monkeypatch):
    """Packing 16 rows at a time gives the stores' bytes of packing whole tensors, and each stream
    is the one the kernel's own preparation (woq.prepare) makes of the whole weight."""
    from sgrt.models.weight_store import open_store

    whole = load_model(str(tiny_gguf), dtype="bfloat16", quantization="int4", cache_dir=tmp_path / "a")
    monkeypatch.setattr(weight_packer, "CHUNK_WEIGHTS", 1)  # (one 16-row block a chunk)
    chunked = load_model(str(tiny_gguf), dtype="bfloat16", quantization="int4", cache_dir=tmp_path / "b")
    a, b = open_store(whole.path), open_store(chunked.path)
    assert a.meta["forms"] == b.meta["forms"] and a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert torch.equal(a[name], b[name]), name
    for i, layer in enumerate(whole.model.layers):
        for proj in weight_packer.FUSED_PROJECTIONS:
            mod = getattr(layer, proj)
            codes, scales, offsets = mod._unfused()
            from sgrt.kernels import woq

            codes = woq.unpack(codes, mod.out_features, mod.in_features, mod.bits)
            again = GroupLinear(codes, scales, offsets, mod.bits)
            assert again.stream_bits == mod.stream_bits and torch.equal(again.packed, mod.packed), (i, proj)


def test_the_store_is_sgrts_own_folder_and_mapped_not_copied(tiny_gguf, tmp_path):
    """A GGUF's cache entry holds no file other engines would load as a model (no config.json, no
    safetensors), and the loaded weights are views of the store's mapped file."""
    lm = load_model(str(tiny_gguf), dtype="bfloat16", quantization="int4", cache_dir=tmp_path)
    entry = lm.path.parent
    assert sorted(p.name for p in entry.iterdir()) == sorted(["source.json", "tokenizer", "tokenizer-snapshot", lm.path.name])
    assert sorted(p.name for p in lm.path.iterdir()) == ["manifest.json", "weights.bin"]
    assert not list(entry.rglob("config.json")) and not list(entry.rglob("*.safetensors"))
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if line.endswith(str(lm.path / "weights.bin"))]
    assert mapped, "weights.bin is not mapped"
    lo, hi = (int(x, 16) for x in mapped[0].split()[0].split("-"))
    for mod in lm.model.modules():
        if isinstance(mod, GroupLinear):
            assert lo <= mod.packed.data_ptr() < hi
    assert lm.model.norm.weight.data_ptr() in range(lo, hi)
    # the store's bytes: the file's blocks repacked (4-bit 20 bytes a group of 32, 8-bit 34-36)
    assert lm.weight_bytes == (lm.path / "weights.bin").stat().st_size
    assert lm.weight_bytes <= 1.5 * tiny_gguf.stat().st_size


# ---- peak memory, in a process of its own --------------------------------------------------------

# NOTE: the peak is VmHWM, this process image's high-water mark: getrusage's ru_maxrss survives
# exec on Linux, so a child forked by a large test process would report the parent's size.
_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from sgrt.models import load_model
def status(key):
    fields = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return int(fields[key].split()[0]) * 1024
torch.zeros(1) + 1  # (torch's own libraries resident)
before = status("VmRSS")
lm = load_model({spec!r}, dtype="bfloat16", quantization="int4", cache_dir={cache!r})
ids = torch.tensor(lm.tokenizer.encode("The capital of France is"))
lm.model.forward_simple(ids)
print(json.dumps({{"before": before, "peak": status("VmHWM"), "converted": lm.converted, "weights": lm.weight_bytes}}))
"""


def _load_in_a_process(spec: str, cache: Path) -> dict:
    code = _CHILD.format(root=str(ROOT), spec=spec, cache=str(cache))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sized_files(tmp_path_factory):
    """A GGUF big enough that a float copy of its weights would show (~29 MB of Q4_1, a 154 MB
    float32 model), and an HF folder of the same shape in bfloat16 (77 MB)."""
    from bench.model_files import write_hf_folder

    shape = Shape("llama", 4, 1024, 2816, 16, 4, context=2048)
    root = tmp_path_factory.mktemp("sized")
    return (write_gguf(root / "sized-q4_1.gguf", shape, Types("Q4_1", {"token_embd": "Q8_0"})),
            write_hf_folder(root / "sized-hf", shape))


@needs_native
@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_peak_memory_of_a_load_is_about_the_files_size(sized_files, tmp_path, kind):
    """A cold load (packing the file) and a warm one (mapping the store) each grow the process by
    at most 1.5x the weights' file plus 150 MB (what a load imports beside torch: the tokenizer,
    the kernels; measured 90-130 MB of the growth); a float32 copy of the GGUF's weights alone
    would be 330 MB more, of the HF folder's 380 MB (the old loader's was 5x a Q4_1 file)."""
    gguf_file, hf_folder = sized_files
    spec = str(gguf_file if kind == "gguf" else hf_folder)
    size = gguf_file.stat().st_size if kind == "gguf" else (hf_folder / "model.safetensors").stat().st_size
    cold = _load_in_a_process(spec, tmp_path)
    warm = _load_in_a_process(spec, tmp_path)
    assert cold["converted"] and not warm["converted"]
    for run in (cold, warm):
        grown = run["peak"] - run["before"]
        assert grown <= 1.5 * size + 150e6, (kind, run, size)


# Q4_K projections everywhere (the K-quant form), a Q8_0 tied table.
K_TYPES = Types("Q4_K", {"token_embd": "Q8_0"})


@needs_native
def test_q4_k_projections_keep_their_super_blocks_exactly(tmp_path, monkeypatch):
    """int4 on the AVX2 build holds Q4_K projections as K-quant streams (woq.fuse_kq4): the
    weights the kernel multiplies by are gguf's dequantization bit for bit (q / k rows unpermuted
    as the float load does), chunked packing writes the bytes of whole tensors, and the streams
    are 37/64 of a byte a weight (4.625 bits)."""
    from sgrt.kernels import woq
    from sgrt.models.weight_store import open_store

    if woq.isa() != "avx2":
        pytest.skip("the K-quant stream is the AVX2 build's")
    path = write_gguf(tmp_path / "tiny-q4_k.gguf", TINY, K_TYPES)
    weights = _read_file(path, groups=False)
    whole = load_model(str(path), dtype="bfloat16", quantization="int4", cache_dir=tmp_path / "a")
    forms = open_store(whole.path).meta["forms"]
    for i, layer in enumerate(whole.model.layers):
        for proj in weight_packer.FUSED_PROJECTIONS:
            mod = getattr(layer, proj)
            assert forms[f"layers.{i}.{proj}"]["kq"] and mod.stream_bits == woq.KQ4_BITS, (i, proj)
            assert mod.packed.numel() * 64 == mod.out_features * mod.in_features * 37
            assert torch.equal(mod.dequantize(), _fused(weights, i, proj)), (i, proj)
    assert not forms["lm_head"]["kq"]
    monkeypatch.setattr(weight_packer, "CHUNK_WEIGHTS", 1)  # (one 16-row block a chunk)
    chunked = load_model(str(path), dtype="bfloat16", quantization="int4", cache_dir=tmp_path / "b")
    a, b = open_store(whole.path), open_store(chunked.path)
    for name in a.tensors:
        assert torch.equal(a[name], b[name]), name
    ids = torch.tensor([1, 2, 3, 4, 5])
    assert torch.equal(whole.model.forward_simple(ids), chunked.model.forward_simple(ids))
