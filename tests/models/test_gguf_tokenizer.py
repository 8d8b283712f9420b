"""Tests of sgrt/models/gguf_tokenizer.py: the tokenizer a cache entry's child builds without
torch is, file for file, the one transformers' ``AutoTokenizer`` builds from the GGUF, for every
family's GGUF model type; the metadata it hands transformers is what transformers' own reader
gives; the child process exits 0 with no torch imported."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.model_files import Shape, Types, write_gguf
from sgrt.models import gguf_tokenizer
from sgrt.models.gguf_convert import read_gguf_metadata
from sgrt.models.registry import families

ROOT = Path(__file__).resolve().parents[2]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _small_gguf(tmp_path: Path, arch: str) -> Path:
    """A one-layer GGUF of ``arch`` with SmolLM2's tokenizer cut to 300 tokens."""
    return write_gguf(tmp_path / f"{arch}.gguf", Shape(arch, 1, 64, 128, 4, 2, context=256), Types("Q8_0"), vocab=300)


def test_table_is_transformers_choice():
    """:data:`TOKENIZER_CLASSES` names, for every model type it holds, the class AutoTokenizer
    takes for it (transformers' mapping; absent -> TokenizersBackend; MistralCommonBackend ->
    TokenizersBackend beside a GGUF), and holds every family's GGUF model type."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    for model_type, name in gguf_tokenizer.TOKENIZER_CLASSES.items():
        want = TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend"
        assert name == ("TokenizersBackend" if want == "MistralCommonBackend" else want), model_type
    for f in families():
        if f.gguf_architectures:
            assert f.hf_model_types[0] in gguf_tokenizer.TOKENIZER_CLASSES, f.name


@pytest.mark.parametrize("arch", ["packaged", "qwen2", "qwen3", "phi3", "gemma3"])
def test_built_directly_is_auto_tokenizers_build(tmp_path, arch):
    """The class from the table, the file read by :func:`transformers_metadata`, writes the same
    files as AutoTokenizer with transformers' own reading, and the same snapshot."""
    from sgrt.models.specs import default_gguf_path

    path = default_gguf_path() if arch == "packaged" else _small_gguf(tmp_path, arch)
    hf_cfg, facts, _, _ = read_gguf_metadata(path, "x")
    model_type = hf_cfg["model_type"]
    direct = gguf_tokenizer._built_directly(path, model_type)
    assert type(direct).__name__ == gguf_tokenizer.TOKENIZER_CLASSES[model_type]
    outs = {}
    for way, given in (("direct", model_type), ("auto", None)):
        out = tmp_path / way
        out.mkdir()
        gguf_tokenizer.write_tokenizer(path, out / "tokenizer", facts, "x", given)
        gguf_tokenizer.write_tokenizer_snapshot(out / "tokenizer", out / "snapshot")
        outs[way] = out
    assert _files(outs["direct"] / "tokenizer") == _files(outs["auto"] / "tokenizer")
    # (Gemma's class over this BPE vocabulary has no unknown token: neither keeps a snapshot)
    kept = [(outs[w] / "snapshot").is_dir() for w in ("direct", "auto")]
    assert kept == [arch != "gemma3"] * 2
    if kept[0]:
        assert (outs["direct"] / "snapshot" / "tokenizer.json").read_bytes() == \
            (outs["auto"] / "snapshot" / "tokenizer.json").read_bytes()
        facts_of = [json.loads((outs[w] / "snapshot" / "facts.json").read_text()) for w in ("direct", "auto")]
        for f in facts_of:
            del f["source"], f["stamp"]
        assert facts_of[0] == facts_of[1] and facts_of[0]["encode"]


def test_a_tokenizer_config_beside_the_file_goes_to_auto_tokenizer(tmp_path):
    """A ``tokenizer_config.json`` beside the GGUF can change AutoTokenizer's choice of class, so
    the table is not used."""
    path = _small_gguf(tmp_path, "qwen2")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert gguf_tokenizer._built_directly(path, "qwen2") is None
    other = tmp_path / "other"
    other.mkdir()
    assert gguf_tokenizer._built_directly(_small_gguf(other, "qwen3"), "no-such-type") is None


@pytest.mark.parametrize("arch", ["packaged", "gemma3"])
def test_metadata_is_transformers_readers(tmp_path, arch):
    """:func:`transformers_metadata` gives what transformers' ``read_gguf_metadata`` gives: the
    same keys in the same order, values of the same types, with and without string arrays."""
    from transformers.integrations.gguf.reader import read_gguf_metadata as theirs

    from sgrt.models.specs import default_gguf_path

    path = default_gguf_path() if arch == "packaged" else _small_gguf(tmp_path, arch)
    for arrays in ((), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")):
        ours, names = gguf_tokenizer.transformers_metadata(path, arrays)
        want, want_names = theirs(str(path), arrays)
        assert list(ours) == list(want) and names == want_names
        for key, value in want.items():
            assert type(ours[key]) is type(value) and ours[key] == value, key


def test_child_builds_the_tokenizer_without_torch(tmp_path):
    """``python -m sgrt.models.gguf_tokenizer`` with the facts on stdin exits 0, writes the
    tokenizer folder (with the generation config's ids) and the snapshot, and never imports torch;
    a file it cannot read exits 1 with the error as JSON."""
    path = _small_gguf(tmp_path, "qwen2")
    hf_cfg, facts, _, _ = read_gguf_metadata(path, "x")
    out = tmp_path / "entry"
    out.mkdir()
    probe = ("import runpy, sys\nsys.argv = ['x'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('sgrt.models.gguf_tokenizer', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n")
    given = json.dumps({"facts": facts, "hf_config": hf_cfg})
    proc = subprocess.run([sys.executable, "-c", "import json\n" + probe, str(path), str(out), "x"],
                          input=given, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 0, "torch": False}, proc.stderr[-2000:]
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "tokenizer-snapshot" / "facts.json").is_file()
    ids = json.loads((out / "tokenizer" / "generation_config.json").read_text())
    assert ids == {"bos_token_id": hf_cfg["bos_token_id"], "eos_token_id": hf_cfg["eos_token_id"]}
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    proc = subprocess.run([sys.executable, "-m", "sgrt.models.gguf_tokenizer", str(bad), str(tmp_path / "e2"), "x"],
                          input=given, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "bad.gguf" in json.loads(proc.stdout.strip().splitlines()[-1])["error"]


def test_a_tokenizer_transformers_cannot_build_fails_the_load_with_its_message(tmp_path):
    """A cold load of a GGUF whose tokenizer model transformers has no converter for: the child's
    ModelLoadError names the file and transformers' reason, and nothing of the entry stays."""
    from sgrt.errors import ModelLoadError
    from sgrt.models import load_model

    good = _small_gguf(tmp_path, "llama").read_bytes()
    at = good.index(b"gpt2", good.index(b"tokenizer.ggml.model"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:at] + b"gptX" + good[at + 4:])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(bad), dtype="float32", cache_dir=tmp_path / "cache")
    assert f"cannot build a tokenizer from {bad}" in str(e.value) and "gptX" in str(e.value)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == []


def test_a_file_our_walk_leaves_fails_as_auto_tokenizer_says(tmp_path):
    """A file :func:`transformers_metadata` does not read (an array of arrays) goes to AutoTokenizer
    (``_built_directly`` gives None), so its failure names what AutoTokenizer's reading names."""
    import gguf

    from sgrt.errors import ModelLoadError

    from .test_gguf_layout import _small

    path = _small(tmp_path / "nested.gguf", "llama", {"token_embd.weight": np.zeros((32, 64), np.float32)},
                  {"test.nested": ([[1, 2], [3]], gguf.GGUFValueType.ARRAY)})
    assert gguf_tokenizer._built_directly(path, "llama") is None
    said = []
    for model_type in ("llama", None):
        with pytest.raises(ModelLoadError) as e:
            gguf_tokenizer.write_tokenizer(path, tmp_path / f"out-{model_type}", {}, "x", model_type)
        said.append(str(e.value))
    assert said[0] == said[1] and "array of type 9" in said[0]
