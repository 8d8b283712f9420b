"""Tests of sgrt/models/gguf_layout.py: a cache entry's metadata read without parsing arrays is
the one ``gguf.GGUFReader``'s parse gives, for every family's file; what it does not take goes to
``gguf``'s reader."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.model_files import Q4_K_M, Shape, Types, write_gguf
from sgrt.models import gguf_convert, gguf_tokenizer
from sgrt.models.checkpoint import GGUFFile, gguf_hf_config
from sgrt.models.gguf_layout import NotReadHere, read_layout
from sgrt.models.weight_files import gguf_tensor_table


def _with_gguf_reader(path: Path) -> tuple:
    reader = GGUFFile(path, "x").reader()
    hf, family, facts = gguf_hf_config(reader, "x")
    table = gguf_tensor_table(reader, family, path, "x", gguf_convert.GGUF_ROPE_TENSORS)
    return hf, facts, table, int(reader.data_offset)


def _small(path: Path, arch: str, tensors: dict[str, np.ndarray], extra: dict | None = None) -> Path:
    """A GGUF of ``arch`` with the shape keys, a small vocabulary, a chat template and ``tensors``
    (float32)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for key, value in (extra or {}).items():
        w.add_key_value(key, value[0], value[1])
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bench_shapes_read_alike(tmp_path):
    """Llama and Qwen2 shapes, every block type the packer meets, SmolLM2's vocabulary."""
    for name, shape, types in [
        ("llama", Shape("llama", 2, 256, 512, 4, 2, context=512),
         Types("Q4_1", {"attn_v": "Q8_0", "ffn_down": "Q6_K"})),
        ("qwen2", Shape("qwen2", 2, 256, 512, 4, 2, context=512, tied=False, qkv_bias=True), Q4_K_M),
    ]:
        path = write_gguf(tmp_path / f"{name}.gguf", shape, types)
        assert gguf_convert.read_gguf_metadata(path, "x") == _with_gguf_reader(path), name


def test_default_model_reads_alike():
    from sgrt.models.specs import resolve_spec

    path = resolve_spec("smollm2-135m-instruct")[1]
    assert gguf_convert.read_gguf_metadata(path, "x") == _with_gguf_reader(path)


def test_rotary_tensors_read_alike(tmp_path):
    """Llama 3.1's ``rope_freqs`` and Phi-3's long / short factors are read from the file."""
    import gguf

    rng = np.random.default_rng(0)
    embd = rng.standard_normal((32, 64)).astype(np.float32)
    llama = _small(tmp_path / "llama.gguf", "llama", {
        "token_embd.weight": embd, "rope_freqs.weight": rng.uniform(1, 8, 8).astype(np.float32)})
    phi = _small(tmp_path / "phi3.gguf", "phi3", {
        "token_embd.weight": embd, "rope_factors_long.weight": rng.uniform(1, 8, 8).astype(np.float32),
        "rope_factors_short.weight": rng.uniform(1, 2, 8).astype(np.float32)},
        {"phi3.rope.scaling.original_context_length": (128, gguf.GGUFValueType.UINT32)})
    for path in (llama, phi):
        new = gguf_convert.read_gguf_metadata(path, "x")
        assert new == _with_gguf_reader(path)
        assert "rope_scaling" in new[0]


def test_what_it_does_not_take_goes_to_gguf(tmp_path):
    """A file cut short, or an array read as a value: :class:`NotReadHere` (the entry's read
    then parses with ``gguf.GGUFReader``, whose errors the faults tests check)."""
    rng = np.random.default_rng(0)
    path = _small(tmp_path / "x.gguf", "llama", {"token_embd.weight": rng.standard_normal((32, 64)).astype(np.float32)})
    layout = read_layout(path)
    with pytest.raises(NotReadHere):
        layout.fields["tokenizer.ggml.tokens"].contents()
    assert len(layout.fields["tokenizer.ggml.tokens"].data) == 32
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(NotReadHere, match="past the end"):
        read_layout(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(path.read_bytes()[:200])
    with pytest.raises(NotReadHere):
        read_layout(head)


def test_gguf_reader_over_a_plain_map_reads_the_same_fields(tmp_path):
    """The entry's child parses for transformers with gguf's reader over a plain ndarray view of
    its map (``_plain_gguf_maps``): every field's parts and every tensor are the same."""
    import gguf

    path = write_gguf(tmp_path / "q.gguf", Shape("qwen2", 1, 256, 512, 4, 2, context=512, qkv_bias=True), Q4_K_M)
    a = gguf.GGUFReader(str(path))
    with gguf_tokenizer._plain_gguf_maps():
        b = gguf.GGUFReader(str(path))
    assert type(b.data) is np.ndarray and isinstance(a.data, np.memmap)
    assert list(a.fields) == list(b.fields)
    for key, fa in a.fields.items():
        fb = b.fields[key]
        assert fa.types == fb.types and fa.data == fb.data and fa.contents() == fb.contents(), key
        assert all(np.array_equal(x, y) for x, y in zip(fa.parts, fb.parts)), key
    for ta, tb in zip(a.tensors, b.tensors):
        assert (ta.name, ta.tensor_type, ta.data_offset) == (tb.name, tb.tensor_type, tb.data_offset)
        assert np.array_equal(ta.data, tb.data)
    assert gguf.gguf_reader.np is np


@pytest.mark.parametrize("which", ["packaged", "written"])
def test_metadata_values_reader_gives_transformers_the_fields_gguf_gives(tmp_path, which):
    """The entry's child hands transformers' GGUF loader :class:`~sgrt.models.gguf_tokenizer.
    MetadataValuesReader` in place of gguf's reader (``_tokenizer_reader``): every field parses
    (transformers' ``_gguf_parse_value``) to the same values, in the same order, and the tensor
    names are the same; the tokenizer it builds is the same files."""
    import gguf
    from transformers.integrations.ggml import _gguf_parse_value

    from sgrt.models.specs import default_gguf_path

    if which == "packaged":
        path = default_gguf_path()
    else:
        path = write_gguf(tmp_path / "q.gguf", Shape("qwen2", 1, 256, 512, 4, 2, context=512, qkv_bias=True), Q4_K_M)
    a = gguf.GGUFReader(str(path))
    with gguf_tokenizer._tokenizer_reader():
        b = gguf.GGUFReader(str(path))
    assert isinstance(b, gguf_tokenizer.MetadataValuesReader) and gguf.GGUFReader is a.__class__
    assert list(a.fields) == list(b.fields)

    def values(field):
        return [_gguf_parse_value(field.parts[i], field.types) for i in field.data]

    for key, fa in a.fields.items():
        fb = b.fields[key]
        assert list(fa.types) == fb.types and values(fa) == values(fb), key
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    if which == "packaged":
        _, facts, _, _ = gguf_convert.read_gguf_metadata(path, "x")
        outs = [tmp_path / "real", tmp_path / "values"]
        saved = gguf_tokenizer._tokenizer_reader
        try:
            gguf_tokenizer._tokenizer_reader = gguf_tokenizer._plain_gguf_maps
            gguf_tokenizer.write_tokenizer(path, outs[0], facts, "x")
        finally:
            gguf_tokenizer._tokenizer_reader = saved
        gguf_tokenizer.write_tokenizer(path, outs[1], facts, "x")
        names = sorted(p.name for p in outs[0].iterdir())
        assert names == sorted(p.name for p in outs[1].iterdir())
        assert all((outs[0] / n).read_bytes() == (outs[1] / n).read_bytes() for n in names)


def test_metadata_values_reader_leaves_arrays_of_arrays_to_gguf(tmp_path):
    """An array of arrays (no model file has one) is left to gguf's reader: the values reader
    raises NotReadHere, and ``_tokenizer_reader`` then opens gguf's."""
    import gguf

    path = _small(tmp_path / "nested.gguf", "llama", {"token_embd.weight": np.zeros((4, 32), np.float32)},
                  {"test.nested": ([[1, 2], [3]], gguf.GGUFValueType.ARRAY)})
    with pytest.raises(NotReadHere):
        gguf_tokenizer.MetadataValuesReader(path)
    with gguf_tokenizer._tokenizer_reader():
        reader = gguf.GGUFReader(str(path))
    assert isinstance(reader, gguf.gguf_reader.GGUFReader) and "test.nested" in reader.fields
