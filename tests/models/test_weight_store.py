"""Tests of damaged and stale caches (sgrt/models/weight_store.py, assemble.py, loader.py): a store
whose files were cut short, overwritten or edited is refused by name before any weight is used,
and a load packs such a store again (or, where it cannot replace it, says what to delete)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from bench.model_files import Shape, Types, write_gguf
from sgrt.errors import ModelLoadError
from sgrt.models import load_model
from sgrt.models.quant import native_kernel_available
from sgrt.models.weight_forms import PACK_VERSION

NATIVE = native_kernel_available()
needs_native = pytest.mark.skipif(not NATIVE, reason="the native kernel did not build here")

# One layer, every block form: q / k / v of three types (an int8-widened projection), Q4_0 o_proj
# (4-bit), the tied head and embedding from the Q8_0 table (the compact stream, looked up).
SMALL = Shape("llama", 1, 256, 512, 4, 2, context=512)
TYPES = Types("Q4_0", {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q8_0", "token_embd": "Q8_0"})
IDS = torch.tensor([1, 504, 300, 421, 30])
VOCAB = 512  # (a cut of SmolLM2's tokenizer: the entry is read again in seconds)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict:
    """A small GGUF, its cache (a float32 store and, with the native kernel, an int4 one) and the
    logits of each, to copy and damage."""
    root = tmp_path_factory.mktemp("store")
    path = write_gguf(root / "small.gguf", SMALL, TYPES, vocab=VOCAB)
    out = {"gguf": path, "cache": root / "cache", "logits": {}, "stores": {}}
    for quantization in ("none", "int4") if NATIVE else ("none",):
        dtype = "float32" if quantization == "none" else "bfloat16"
        lm = load_model(str(path), dtype=dtype, quantization=quantization, cache_dir=out["cache"])
        out["logits"][quantization] = lm.model.forward_simple(IDS)
        out["stores"][quantization] = lm.path
        out["config"] = lm.config
    return out


def _copy(small: dict, tmp_path: Path, quantization: str) -> tuple[Path, Path]:
    """A private copy of the pristine cache: (cache root, the store of ``quantization``)."""
    cache = tmp_path / "cache"
    shutil.copytree(small["cache"], cache)
    return cache, cache / small["stores"][quantization].relative_to(small["cache"])


def _edit(store: Path, change) -> None:
    m = json.loads((store / "manifest.json").read_text())
    change(m)
    (store / "manifest.json").write_text(json.dumps(m))


def _first(m: dict, suffix: str) -> dict:
    return next(v for k, v in m["tensors"].items() if k.endswith(suffix))


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


# (what was done to the store, quantization of the store it was done to, the change)
DAMAGES = {
    "weights.bin cut in half": ("none", lambda s: _truncate(s / "weights.bin", (s / "weights.bin").stat().st_size // 2)),
    "weights.bin cut by 64 bytes": ("none", lambda s: _truncate(s / "weights.bin", (s / "weights.bin").stat().st_size - 64)),
    "weights.bin empty": ("none", lambda s: _truncate(s / "weights.bin", 0)),
    "weights.bin longer": ("none", lambda s: _truncate(s / "weights.bin", (s / "weights.bin").stat().st_size + 4096)),
    "no weights.bin": ("none", lambda s: os.unlink(s / "weights.bin")),
    "manifest not JSON": ("none", lambda s: (s / "manifest.json").write_text("{garbage")),
    "manifest null": ("none", lambda s: (s / "manifest.json").write_text("null")),
    "manifest a list": ("none", lambda s: (s / "manifest.json").write_text("[]")),
    "no manifest": ("none", lambda s: os.unlink(s / "manifest.json")),
    "no tensors": ("none", lambda s: _edit(s, lambda m: m.pop("tensors"))),
    "tensors a list": ("none", lambda s: _edit(s, lambda m: m.__setitem__("tensors", []))),
    "a tensor's offset moved": ("none", lambda s: _edit(s, lambda m: _first(m, "input_layernorm.weight").__setitem__(
        "offset", _first(m, "input_layernorm.weight")["offset"] + 64))),
    "a negative offset": ("none", lambda s: _edit(s, lambda m: _first(m, "norm.weight").__setitem__("offset", -64))),
    "a norm's shape": ("none", lambda s: _edit(s, lambda m: _first(m, "input_layernorm.weight").__setitem__(
        "shape", [128]))),
    "a norm's dtype": ("none", lambda s: _edit(s, lambda m: _first(m, "input_layernorm.weight").__setitem__(
        "dtype", "bfloat16"))),
    "an unknown dtype": ("none", lambda s: _edit(s, lambda m: _first(m, "norm.weight").__setitem__("dtype", "int32"))),
    "a tensor missing": ("none", lambda s: _edit(s, lambda m: m["tensors"].pop("norm.weight"))),
    "no meta": ("none", lambda s: _edit(s, lambda m: m.pop("meta"))),
    "no forms": ("none", lambda s: _edit(s, lambda m: m["meta"].pop("forms"))),
    "another target's store": ("none", lambda s: _edit(s, lambda m: m["meta"].__setitem__(
        "target", f"bfloat16-none-plain-v{PACK_VERSION}"))),
    "a form's rows": ("int4", lambda s: _edit(s, lambda m: m["meta"]["forms"]["layers.0.o_proj"].__setitem__(
        "rows", 128))),
    "a form's bits": ("int4", lambda s: _edit(s, lambda m: m["meta"]["forms"]["layers.0.o_proj"].__setitem__(
        "bits", 8))),
    "a form's kernel bits": ("int4", lambda s: _edit(s, lambda m: m["meta"]["forms"]["layers.0.qkv_proj"].__setitem__(
        "stream_bits", 4))),
    "a form missing": ("int4", lambda s: _edit(s, lambda m: m["meta"]["forms"].pop("layers.0.o_proj"))),
    "an unknown form": ("int4", lambda s: _edit(s, lambda m: m["meta"]["forms"]["layers.0.o_proj"].__setitem__(
        "form", "int3"))),
    "a form for no weight": ("int4", lambda s: _edit(s, lambda m: m["meta"]["forms"].__setitem__(
        "layers.7.o_proj", m["meta"]["forms"]["layers.0.o_proj"]))),
    "the embedding's source": ("int4", lambda s: _edit(s, lambda m: m["meta"].__setitem__("embedding", "group"))),
    "the quantization": ("int4", lambda s: _edit(s, lambda m: m["meta"].__setitem__("quantization", "int8"))),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_store_is_packed_again(small, tmp_path, damage):
    """Every way a store's two files can be cut short, overwritten or edited is found when the
    store is opened or assembled (the layout of weights.bin, each tensor's dtype and shape, each
    form against the model's shapes and the kernels' layouts), before a weight is used: the load
    moves the store aside, packs it again and gives the file's logits, and leaves nothing behind."""
    quantization, change = DAMAGES[damage]
    if quantization not in small["stores"]:
        pytest.skip("the native kernel did not build here")
    cache, store = _copy(small, tmp_path, quantization)
    change(store)
    dtype = "float32" if quantization == "none" else "bfloat16"
    lm = load_model(str(small["gguf"]), dtype=dtype, quantization=quantization, cache_dir=cache)
    assert lm.converted and lm.path == store
    assert torch.equal(lm.model.forward_simple(IDS), small["logits"][quantization])
    assert sorted(p.name for p in store.parent.iterdir()) == sorted(
        ["source.json", "tokenizer", "tokenizer-snapshot", *(p.name for p in small["stores"].values())])


def test_a_damaged_store_that_cannot_be_replaced_is_named_with_the_fix(small, tmp_path, monkeypatch):
    """Where the damaged store cannot be moved aside (a read-only cache), the load raises
    ModelLoadError naming the store, what is wrong with it and what to do."""
    cache, store = _copy(small, tmp_path, "none")
    _truncate(store / "weights.bin", 100)
    real = os.rename

    def refuse(src, dst, *a, **k):
        if Path(src) == store:
            raise PermissionError(13, "Permission denied", str(src))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(small["gguf"]), dtype="float32", cache_dir=cache)
    msg = str(e.value)
    assert str(store) in msg and "weights.bin" in msg and "delete" in msg and "SGRT_CACHE_DIR" in msg


# ---- a GGUF's cache entry ------------------------------------------------------------------------

def _entry(small: dict, cache: Path) -> Path:
    return cache / small["stores"]["none"].parent.relative_to(small["cache"])


def _edit_source(entry: Path, change) -> None:
    src = json.loads((entry / "source.json").read_text())
    change(src)
    (entry / "source.json").write_text(json.dumps(src))


# (what was done to the entry, what entry_problem says of it: None where only loading the
# tokenizer finds it)
ENTRY_DAMAGES = {
    "no source.json": (lambda e: os.unlink(e / "source.json"), "cannot read source.json"),
    "source.json not JSON": (lambda e: (e / "source.json").write_text('{"format": "sgrt-gguf-source", "hf'),
                             "cannot read source.json"),
    "source.json empty": (lambda e: (e / "source.json").write_text("{}"), "is not one converter version"),
    "source.json of another converter": (
        lambda e: _edit_source(e, lambda s: s.__setitem__("converter_version", 1)), "is not one converter version"),
    "a tensor past the file's end": (
        lambda e: _edit_source(e, lambda s: s["tensors"][-1].__setitem__(2, 1 << 40)), "runs past the file's"),
    "a tensor entry cut short": (lambda e: _edit_source(e, lambda s: s["tensors"][0].pop()), "malformed tensor entry"),
    "no hf_config": (lambda e: _edit_source(e, lambda s: s.pop("hf_config")), "lacks its config"),
    "another file's size": (lambda e: _edit_source(e, lambda s: s.__setitem__("size", s["size"] + 1)),
                            "from a file of"),
    "no tokenizer folder": (lambda e: shutil.rmtree(e / "tokenizer"), "no tokenizer/tokenizer.json"),
    "no tokenizer.json": (lambda e: os.unlink(e / "tokenizer" / "tokenizer.json"), "no tokenizer/tokenizer.json"),
    "no tokenizer_config.json": (lambda e: os.unlink(e / "tokenizer" / "tokenizer_config.json"),
                                 "no tokenizer/tokenizer_config.json"),
    "tokenizer.json not JSON": (lambda e: (e / "tokenizer" / "tokenizer.json").write_text("{garbage"), None),
    "tokenizer_config.json not JSON": (
        lambda e: (e / "tokenizer" / "tokenizer_config.json").write_text("{garbage"), None),
}


@pytest.mark.parametrize("damage", list(ENTRY_DAMAGES))
def test_a_damaged_gguf_entry_is_found(small, tmp_path, damage):
    """Every way a GGUF entry's source.json or tokenizer can be missing, unreadable, of another
    converter or inconsistent with the file is found before it is used: by entry_problem (which
    a load runs on every entry it finds), or, for tokenizer files that are not JSON, by loading
    the tokenizer, a ModelLoadError naming the folder (the load then reads the entry again)."""
    from sgrt.models.gguf_convert import entry_problem
    from sgrt.models.loader import _folder_tokenizer

    cache, _ = _copy(small, tmp_path, "none")
    entry = _entry(small, cache)
    assert entry_problem(entry, small["gguf"]) == (None, True)  # (the pristine copy)
    change, said = ENTRY_DAMAGES[damage]
    change(entry)
    problem, stores_hold = entry_problem(entry, small["gguf"])
    if said is None:
        assert problem is None
        with pytest.raises(ModelLoadError, match="no loadable tokenizer in .*tokenizer"):
            _folder_tokenizer(entry / "tokenizer", small["config"])
    else:
        assert problem is not None and said in problem
        assert stores_hold == (damage != "another file's size")


@pytest.mark.parametrize("damage", ["no source.json", "tokenizer.json not JSON"])
def test_a_damaged_gguf_entry_is_read_again_keeping_its_stores(small, tmp_path, damage):
    """A damaged entry (found by entry_problem, or by its tokenizer failing to load) is read from
    the GGUF again, its source.json and tokenizer replaced in place: the load gives the file's
    logits and tokens, and the entry's weight stores, which depend on the file's bytes alone, are
    kept (not packed again); nothing is left beside them."""
    from sgrt.models import load_tokenizer

    cache, store = _copy(small, tmp_path, "none")
    ENTRY_DAMAGES[damage][0](_entry(small, cache))
    text = "Hello tiny world, 人工智能 😀"
    want = load_tokenizer(str(small["gguf"]), cache_dir=small["cache"]).encode(text)
    lm = load_model(str(small["gguf"]), dtype="float32", cache_dir=cache)
    assert lm.path == store and not lm.converted
    assert torch.equal(lm.model.forward_simple(IDS), small["logits"]["none"])
    assert lm.tokenizer.encode(text) == want and lm.config == small["config"]
    assert sorted(p.name for p in store.parent.iterdir()) == sorted(
        ["source.json", "tokenizer", "tokenizer-snapshot", *(p.name for p in small["stores"].values())])
    assert sorted(p.name for p in store.parent.parent.iterdir()) == [store.parent.name]


def test_metadata_edited_in_place_is_read_again(small, tmp_path, monkeypatch):
    """A file past the whole-file hash limit is keyed by its size and samples of its bytes, which
    an in-place metadata edit of the same size (gguf-set-metadata: here the end-of-text id) can
    miss; the entry's hash of the whole metadata sees it, and the entry is read again, stores
    included (they follow from the config)."""
    import gguf

    from sgrt.models import gguf_convert

    monkeypatch.setattr(gguf_convert, "FULL_HASH_MAX_BYTES", 64 << 10)
    monkeypatch.setattr(gguf_convert, "SAMPLE_BYTES", 4096)
    path = tmp_path / "small.gguf"
    shutil.copy(small["gguf"], path)
    cache = tmp_path / "cache"
    # (the pristine entry, under the key the file has past the limit: the first load is warm)
    shutil.copytree(_entry(small, small["cache"]), gguf_convert.gguf_entry(path, cache))
    first = load_model(str(path), dtype="float32", cache_dir=cache)
    assert first.config.eos_token_id == 2 and not first.converted
    key = gguf_convert.gguf_cache_key(path)
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields["tokenizer.ggml.eos_token_id"]
    field.parts[field.data[0]][0] = 7
    reader.data.flush()
    del reader, field
    assert gguf_convert.gguf_cache_key(path) == key  # (the samples did not see the edit)
    again = load_model(str(path), dtype="float32", cache_dir=cache)
    assert again.config.eos_token_id == 7 and 7 in again.tokenizer.eos_token_ids
    assert again.converted
    assert torch.equal(again.model.forward_simple(IDS), small["logits"]["none"])


def test_temporary_folders_of_dead_builders_are_swept(small, tmp_path):
    """A process killed while it packed a store or read a GGUF leaves its temporary folder (a
    store's is as large as the store); the next build beside it deletes the folders no live
    builder holds, and keeps a live one's."""
    import fcntl

    cache, store = _copy(small, tmp_path, "none")
    entry = store.parent
    shutil.rmtree(store)
    dead = [entry / f".tmp-{store.name}-dead1", entry / f".stale-{store.name}-dead2",
            entry.parent / f".tmp-{entry.name}-dead3"]
    live = entry / f".tmp-bfloat16-int8-plain-v{PACK_VERSION}-live"  # (another target's: a load of this one does not wait)
    for folder in (*dead, live):
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"\0" * 4096)
        os.utime(folder, (0, 0))  # (older than the sweep's grace period)
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a builder at work)
        os.unlink(entry / "source.json")  # (the entry is read again: a build in gguf/ too)
        lm = load_model(str(small["gguf"]), dtype="float32", cache_dir=cache)
        assert lm.converted and torch.equal(lm.model.forward_simple(IDS), small["logits"]["none"])
        assert [f for f in dead if f.exists()] == [] and live.is_dir()
    finally:
        os.close(fd)
