"""Tests of bench/decode_bytes.py: the bytes a decode token reads, counted from a GGUF's tensors and
from the int4-loaded model's kernel streams, on a tiny Q4_K_M-like file."""
from __future__ import annotations

import pytest

from bench.decode_bytes import file_classes, sgrt_classes
from bench.model_files import Q4_K_M, Shape, write_gguf
from sgrt.models.quant import native_kernel_available

TINY = Shape("qwen2", 2, 256, 512, 4, 2, context=512, tied=True, qkv_bias=True)


def test_file_classes_count_every_projection_and_the_tied_head(tmp_path):
    """Every layer projection falls in one class, the tied embedding is the head, and the classes'
    bytes are the tensors' (nothing else: norms and biases are not counted)."""
    import gguf

    path = write_gguf(tmp_path / "q.gguf", TINY, Q4_K_M, vocab=300)
    classes, size = file_classes(path)
    assert set(classes) == {"qkv", "o", "gate_up", "down", "head"}
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert "output.weight" not in tensors
    assert classes["head"]["bytes"] == int(tensors["token_embd.weight"].n_bytes)
    counted = [t for n, t in tensors.items() if n.endswith(".weight") and t.tensor_type.name not in ("F32", "F16")]
    assert sum(c["bytes"] for c in classes.values()) == sum(int(t.n_bytes) for t in counted)
    assert set(classes["down"]["types"]) == {"Q4_K", "Q6_K"}  # (Q6_K every other layer)
    assert size == path.stat().st_size


@pytest.mark.skipif(not native_kernel_available(), reason="the native kernel did not build here")
def test_sgrt_classes_cover_every_quantized_projection(tmp_path):
    """The loaded model's groups hold every layer's four projections and the head once, with the
    bits a weight of their streams (4.625 for a K-quant stream, 5 for the per-32 4-bit form, 9 for
    8-bit codes with a scale and offset per 32)."""
    path = write_gguf(tmp_path / "q.gguf", TINY, Q4_K_M, vocab=304)  # (304 rows: a quantized head)
    rows = sgrt_classes(path, threads=1, passes=1, cache_dir=tmp_path / "cache")
    per_proj = {}
    for r in rows:
        per_proj[r["proj"]] = per_proj.get(r["proj"], 0) + r["count"]
        assert r["seconds"] > 0 and r["bytes"] > 0
        assert r["bits"] in (pytest.approx(4.625), pytest.approx(5.0), pytest.approx(5.5), pytest.approx(8.5),
                             pytest.approx(9.0)), r
    heads = {p: c for p, c in per_proj.items() if p not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert {p: per_proj[p] for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} == dict.fromkeys(
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), TINY.layers)
    assert sum(heads.values()) == 1
