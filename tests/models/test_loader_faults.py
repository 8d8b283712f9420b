"""Tests of the loader against the faults users meet (sgrt/models/gguf_check.py, gguf_convert.py,
checkpoint.py, loader.py): a GGUF cut short or corrupt is refused by a ModelLoadError naming the
file and what is wrong; a load killed while it writes the cache leaves nothing the next load uses;
two processes loading one uncached model pack it once and agree; a full or read-only cache is
named with the fix, and a read-only one still loads what it holds; tensor types the kernels have
no form for are dequantized a chunk of rows at a time.

The GGUFs are small random-weight files with a 512-token cut of SmolLM2's tokenizer, so a GGUF
read (a child process) takes seconds."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bench.model_files import Shape, Types, write_gguf
from sgrt.errors import ModelLoadError
from sgrt.models import gguf_convert, load_model, weight_packer
from sgrt.models.checkpoint import unpermute_rotary
from sgrt.models.gguf_check import gguf_layout_problem
from sgrt.models.quant import native_kernel_available
from sgrt.models.weight_forms import PACK_VERSION

ROOT = Path(__file__).resolve().parents[2]
TINY = Shape("llama", 1, 256, 512, 4, 2, context=512)
TYPES = Types("Q4_0", {"token_embd": "Q8_0"})
VOCAB = 512
IDS = torch.tensor([1, 300, 17, 460, 2])
STORE = f"float32-none-plain-v{PACK_VERSION}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A small GGUF, a cache holding its entry and float32 store, and that model's logits."""
    root = tmp_path_factory.mktemp("faults")
    path = write_gguf(root / "tiny.gguf", TINY, TYPES, vocab=VOCAB)
    lm = load_model(str(path), dtype="float32", cache_dir=root / "cache")
    assert lm.path.name == STORE
    return {"gguf": path, "cache": root / "cache", "entry": lm.path.parent, "logits": lm.model.forward_simple(IDS)}


def _copy_cache(tiny: dict, tmp_path: Path, store: bool = True) -> tuple[Path, Path]:
    """A private copy of the cache (without the store unless ``store``): (cache, entry)."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny["cache"], cache)
    entry = cache / tiny["entry"].relative_to(tiny["cache"])
    if not store:
        shutil.rmtree(entry / STORE)
    return cache, entry


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- a GGUF cut short or corrupt -------------------------------------------------------------------

def _layout(path: Path) -> dict:
    """Byte offsets in the file: the start of each metadata entry's value (by key) and of each
    tensor description (by name), and where the data starts."""
    r = gguf.GGUFReader(str(path))
    values = {k: f.offset + 8 + len(k.encode()) + 4 for k, f in r.fields.items()}
    tensors = {t.name: t.field.offset + 8 + len(t.name.encode()) for t in r.tensors}
    return {"values": values, "tensors": tensors, "data": r.data_offset,
            "first_tensor": r.tensors[0].field.offset, "dims": {t.name: len(t.shape) for t in r.tensors}}


def _set(data: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def _type_at(lay: dict, name: str) -> int:
    """Where tensor ``name``'s type id is (after its dimension count and dimensions)."""
    return lay["tensors"][name] + 4 + 8 * lay["dims"][name]


# (how the file is damaged, what the error says about it)
CORRUPTIONS = {
    "empty": (lambda d, lay: b"", "the file is empty"),
    "a text file": (lambda d, lay: b"not a model\n" * 20, "does not start with GGUF's magic"),
    "version 99": (lambda d, lay: _set(d, 4, "<I", 99), "GGUF version 99"),
    "cut in the header": (lambda d, lay: d[:16], "ends inside the header"),
    "cut in the vocabulary": (lambda d, lay: d[:lay["values"]["tokenizer.ggml.tokens"] + 2000],
                              "'tokenizer.ggml.tokens': an array of 512 items, more than the file holds"),
    "cut in the merges": (lambda d, lay: d[:lay["values"]["tokenizer.ggml.merges"] + 3000],
                          "the file ends inside metadata 'tokenizer.ggml.merges', item"),
    "cut in the tensor descriptions": (lambda d, lay: d[:lay["first_tensor"] + 30],
                                       "ends inside the description of tensor 'token_embd.weight'"),
    "cut before the data": (lambda d, lay: d[:lay["data"]], "tensor 'token_embd.weight' (Q8_0, 512 x 256) lies"),
    "cut in the last tensor": (lambda d, lay: d[:-1000], "tensor 'output_norm.weight' (F32, 256) lies at"),
    "2**62 metadata entries": (lambda d, lay: _set(d, 16, "<Q", 1 << 62), "claims 4611686018427387904 metadata"),
    "2**62 tensors": (lambda d, lay: _set(d, 8, "<Q", 1 << 62), "claims 4611686018427387904 tensors"),
    "a key of 2**60 bytes": (lambda d, lay: _set(d, 24, "<Q", 1 << 60), "metadata entry 0 has a string of"),
    "an array of 2**60 tokens": (lambda d, lay: _set(d, lay["values"]["tokenizer.ggml.tokens"] + 4, "<Q", 1 << 60),
                                 "'tokenizer.ggml.tokens': an array of 1152921504606846976 items"),
    "a tensor of 2**30 dimensions": (lambda d, lay: _set(d, lay["tensors"]["output_norm.weight"], "<I", 1 << 30),
                                     "'output_norm.weight' has 1073741824 dimensions"),
    "dimensions whose product overflows": (
        lambda d, lay: _set(_set(d, lay["tensors"]["blk.0.attn_q.weight"] + 4, "<Q", 1 << 33),
                            lay["tensors"]["blk.0.attn_q.weight"] + 12, "<Q", 1 << 31),
        "'blk.0.attn_q.weight' (Q4_0, 2147483648 x 8589934592) lies"),
    "rows not whole blocks": (lambda d, lay: _set(d, lay["tensors"]["blk.0.attn_q.weight"] + 4, "<Q", 250),
                              "rows of 250 values are not whole Q4_0 blocks of 32"),
    "an unknown tensor type": (lambda d, lay: _set(d, _type_at(lay, "output_norm.weight"), "<I", 99),
                               "type id 99, which is no GGML type"),
    "a data offset past the end": (lambda d, lay: _set(d, _type_at(lay, "output_norm.weight") + 4, "<Q", 1 << 40),
                                   "'output_norm.weight' (F32, 256) lies at bytes 1099511"),
    "a misaligned data offset": (lambda d, lay: _set(d, _type_at(lay, "output_norm.weight") + 4, "<Q", 1),
                                 "'output_norm.weight' in {path} starts at byte"),
    # (read by gguf, refused by what sgrt makes of it)
    "an integer tensor": (lambda d, lay: _set(d, _type_at(lay, "output_norm.weight"), "<I",
                                              gguf.GGMLQuantizationType.I32),
                          "tensor 'output_norm.weight' in {path} has type I32, which sgrt cannot read"),
    "no embedding length": (lambda d, lay: d.replace(b"llama.embedding_length", b"llama.embedding_lengtX"),
                            "metadata of {path} lacks llama.embedding_length"),
    "zero heads": (lambda d, lay: _set(d, lay["values"]["llama.attention.head_count"], "<I", 0),
                   "llama.attention.head_count = 0, not a positive integer"),
    "heads that do not divide the width": (
        lambda d, lay: _set(d, lay["values"]["llama.attention.head_count"], "<I", 3),
        "llama.embedding_length = 256, not a multiple of llama.attention.head_count = 3"),
    "query heads not a multiple of kv heads": (
        lambda d, lay: _set(d, lay["values"]["llama.attention.head_count_kv"], "<I", 3),
        "num_attention_heads = 4, not a multiple of num_key_value_heads = 3"),
    "an architecture no family reads": (lambda d, lay: d.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                                 b"\x05\x00\x00\x00\x00\x00\x00\x00llamb", 1),
                                        "GGUF architecture 'llamb' of {path} is not supported"),
}


def _corrupt(tiny: dict, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """The tiny GGUF damaged as ``damage`` says, at ``tmp_path/<name>.gguf``: (path, expected message)."""
    change, said = CORRUPTIONS[damage]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(change(tiny["gguf"].read_bytes(), _layout(tiny["gguf"])))
    return path, said.format(path=path)


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_a_corrupt_gguf_is_named_with_what_is_wrong(tiny, tmp_path, damage):
    """Every way a GGUF's header, metadata, tensor descriptions or data extents can be cut short or
    overwritten is refused by the one parse a load makes (read_gguf_metadata, which the reading
    child runs) with a ModelLoadError that names the file and what is wrong, never numpy's or
    struct's errors, a hang or an allocation the size of a bogus count."""
    path, said = _corrupt(tiny, tmp_path, damage)
    with pytest.raises(ModelLoadError) as e:
        gguf_convert.read_gguf_metadata(path, "spec")
    msg = str(e.value)
    assert str(path) in msg and said in msg, msg
    assert "reshape" not in msg and "index" not in msg and "Traceback" not in msg


def test_the_layout_check_passes_whole_files(tiny):
    """The check that explains a failed parse finds nothing wrong with whole files: the tiny one
    and the default model's (Gemma-size vocabularies, chat template, every metadata type)."""
    from sgrt.models.specs import default_gguf_path

    assert gguf_layout_problem(tiny["gguf"]) is None
    assert gguf_layout_problem(default_gguf_path()) is None


@pytest.mark.parametrize("damage", ["cut in the last tensor", "zero heads", "an integer tensor"])
def test_a_corrupt_gguf_fails_the_load_with_its_message(tiny, tmp_path, damage):
    """Through load_model (the file read in a child process): the child's message reaches the
    caller whole, as a ModelLoadError, and the cache keeps nothing of the attempt."""
    path, said = _corrupt(tiny, tmp_path, damage)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), dtype="float32", cache_dir=cache)
    assert said in str(e.value) and "Traceback" not in str(e.value)
    assert _listing(cache / "gguf") == []


def test_an_unexpected_failure_in_the_reading_child_is_typed(tiny, tmp_path, monkeypatch, capsys):
    """The child (gguf_convert.main) turns what its checks did not foresee into a message naming
    the file and the exception, and a cache with no room into the fix; a child killed by a signal
    is named as such by the parent."""
    out = tmp_path / "entry"
    out.mkdir()

    def fails(exc):
        def build(*a, **k):
            raise exc
        return build

    monkeypatch.setattr(gguf_convert, "build_gguf_source", fails(RuntimeError("a surprise")))
    assert gguf_convert.main([str(tiny["gguf"]), str(out), "spec"]) == 1
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert error == f"model 'spec': reading GGUF {tiny['gguf']} failed: RuntimeError: a surprise"

    full = OSError(errno.ENOSPC, "No space left on device", str(out / "tokenizer" / "tokenizer.json"))
    monkeypatch.setattr(gguf_convert, "build_gguf_source", fails(full))
    assert gguf_convert.main([str(tiny["gguf"]), str(out), "spec"]) == 1
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert f"cannot write the cache entry of {tiny['gguf']} in {tmp_path}" in error
    assert "No space left on device" in error and "SGRT_CACHE_DIR" in error

    killed = subprocess.CompletedProcess([], -signal.SIGKILL, "", "")
    msg = gguf_convert._child_error(killed, "spec", tiny["gguf"])
    assert f"reading {tiny['gguf']} failed (the process reading it was killed by SIGKILL (out of memory?))" in msg


# ---- tensor types the kernels have no form for --------------------------------------------------------

ODD_TYPES = Types("Q4_0", {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS",
                           "ffn_gate": "BF16", "ffn_up": "F16", "token_embd": "Q8_0"})
# GGUF name -> canonical weight (q / k rows in llama.cpp's rotary order, unpermuted by heads)
ODD_ROLES = {"blk.0.attn_q.weight": ("qkv_proj", 0, TINY.heads), "blk.0.attn_k.weight": ("qkv_proj", 1, TINY.kv_heads),
             "blk.0.attn_v.weight": ("qkv_proj", 2, None), "blk.0.attn_output.weight": ("o_proj", 0, None),
             "blk.0.ffn_gate.weight": ("gate_up_proj", 0, None), "blk.0.ffn_up.weight": ("gate_up_proj", 1, None),
             "blk.0.ffn_down.weight": ("down_proj", 0, None)}


def test_types_the_kernels_cannot_read_are_dequantized_a_chunk_at_a_time(tmp_path, monkeypatch):
    """Q2_K, Q3_K, IQ4_NL, IQ4_XS, BF16 and F16 projections (no form of sgrt's kernels) load: in
    float32 each is gguf's dequantization of the file's tensor, read 16 rows at a time where the
    chunk is that small (never the tensor whole); in int4 mode they are quantized at load and the
    logits stay near float32's."""
    from sgrt.models.weight_files import CheckpointTensors

    path = write_gguf(tmp_path / "odd.gguf", TINY, ODD_TYPES, vocab=VOCAB)
    reads = []
    real = CheckpointTensors.read_float

    def spy(self, entry, r0, r1, bf16=False):
        reads.append((entry.name, r1 - r0, entry.rows))
        return real(self, entry, r0, r1, bf16)

    monkeypatch.setattr(CheckpointTensors, "read_float", spy)
    monkeypatch.setattr(weight_packer, "CHUNK_WEIGHTS", 16 * TINY.hidden)  # (16 rows of 256 columns)
    lm = load_model(str(path), dtype="float32", cache_dir=tmp_path / "cache", prepack=False)
    layer = lm.model.layers[0]
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name in ODD_ROLES:
            proj, i, heads = ODD_ROLES[t.name]
            w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            w = w.reshape(int(t.shape[1]), int(t.shape[0]))
            parts.setdefault(proj, {})[i] = unpermute_rotary(w, heads) if heads else w
    for proj, pieces in parts.items():
        assert torch.equal(getattr(layer, proj).weight, torch.cat([pieces[i] for i in sorted(pieces)])), proj
    # (a chunk of q / k rows reads the whole heads it touches, to unpermute them: 64 rows)
    assert {rows for n, rows, total in reads if n.endswith("gate_proj.weight")} == {16}
    assert {rows for n, rows, total in reads if n.endswith("q_proj.weight")} == {TINY.hidden // TINY.heads}
    logits = lm.model.forward_simple(IDS)
    assert bool(logits.isfinite().all())
    if native_kernel_available():
        q = load_model(str(path), dtype="bfloat16", quantization="int4", cache_dir=tmp_path / "cache")
        # qkv, o_proj and gate_up quantized from dequantized rows; down_proj and the head the file's blocks
        assert q.counts["quantized"] == 3 and q.counts["blocks"] == 2
        got = q.model.forward_simple(IDS).float()
        assert (got - logits).abs().max() < 0.1 * logits.abs().max()


# ---- a load killed while it writes the cache ----------------------------------------------------------

KILLED_WHILE_PACKING = """
import os, signal, sys
from sgrt.models import load_model, weight_store
real = weight_store.StoreWriter.write
def write(self, *a, **k):
    real(self, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # (after the first chunk: a weights.bin half written)
weight_store.StoreWriter.write = write
load_model(sys.argv[1], dtype="float32", cache_dir=sys.argv[2])
"""


def test_a_load_killed_while_packing_leaves_nothing_the_next_load_uses(tiny, tmp_path, monkeypatch):
    """A process killed in the middle of packing leaves its temporary folder (a partial
    weights.bin) and no store; the next load packs the store again, gives the file's logits, and
    deletes the dead process's folder."""
    cache, entry = _copy_cache(tiny, tmp_path, store=False)
    proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_PACKING, str(tiny["gguf"]), str(cache)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = [p for p in entry.iterdir() if p.name.startswith(".tmp-")]
    assert len(left) == 1 and (left[0] / "weights.bin").is_file() and not (entry / STORE).exists()
    monkeypatch.setattr(gguf_convert, "SWEEP_AFTER_SECONDS", 0.0)
    lm = load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
    assert lm.converted and lm.path == entry / STORE
    assert torch.equal(lm.model.forward_simple(IDS), tiny["logits"])
    assert _listing(entry) == sorted(["source.json", "tokenizer", "tokenizer-snapshot", STORE])


def test_a_killed_gguf_reader_is_named_and_the_next_load_reads_the_file(tiny, tmp_path, monkeypatch):
    """The child reading a GGUF killed after writing part of the entry (an OOM kill): the load
    raises a ModelLoadError naming the file and the signal, nothing of the entry stays, and the
    next load reads the file and gives its logits."""
    cache = tmp_path / "cache"
    real = subprocess.Popen

    def killed_child(cmd, **kw):
        out = cmd[-2]  # (the entry's temporary folder)
        return real([sys.executable, "-c", "import os, signal, sys; open(sys.argv[1] + '/source.json', 'w')"
                     ".write('{\"format'); os.kill(os.getpid(), signal.SIGKILL)", out], **kw)

    monkeypatch.setattr(gguf_convert.subprocess, "Popen", killed_child)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
    assert f"reading {tiny['gguf']} failed (the process reading it was killed by SIGKILL" in str(e.value)
    assert _listing(cache / "gguf") == []
    monkeypatch.setattr(gguf_convert.subprocess, "Popen", real)
    lm = load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
    assert lm.converted and torch.equal(lm.model.forward_simple(IDS), tiny["logits"])


# ---- two processes, one uncached model -----------------------------------------------------------------

class _Said(logging.Handler):
    """Sets ``event`` when a record's message holds ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_a_load_waits_for_another_process_packing_the_same_store(tiny, tmp_path, monkeypatch):
    """A load that finds another builder's locked temporary folder for its store waits for it and
    maps what that builder published, packing nothing itself (here the other builder is this
    thread, holding the lock as another process would: flock locks conflict between open files)."""
    from sgrt.models.weight_store import MANIFEST_FILE

    cache, entry = _copy_cache(tiny, tmp_path, store=False)
    packs = []
    real = weight_packer.Packer.pack_model
    monkeypatch.setattr(weight_packer.Packer, "pack_model", lambda self: packs.append(1) or real(self))
    said = _Said("waiting for another process that is building")
    logger = logging.getLogger("sgrt.models")
    logger.addHandler(said)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    result: dict = {}

    def load() -> None:
        try:
            result["lm"] = load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
        except BaseException as e:  # (reported by the assertions below)
            result["error"] = e

    try:
        with gguf_convert.building(entry / STORE, "spec") as tmp:
            loader = threading.Thread(target=load)
            loader.start()
            assert said.event.wait(120), result.get("error")
            for f in (tiny["entry"] / STORE).iterdir():
                shutil.copy(f, tmp / f.name)
            assert gguf_convert.publish_folder(tmp, entry / STORE, MANIFEST_FILE)
        loader.join(120)
    finally:
        logger.removeHandler(said)
        logger.setLevel(old_level)
    assert "error" not in result, result.get("error")
    lm = result["lm"]
    assert packs == [] and not lm.converted and lm.path == entry / STORE
    assert torch.equal(lm.model.forward_simple(IDS), tiny["logits"])


def test_a_builder_that_does_not_finish_is_waited_for_only_so_long(tiny, tmp_path, monkeypatch):
    """A builder that holds its folder and never publishes (a stopped process) is waited for
    WAIT_FOR_BUILDER_SECONDS; then the load packs the store itself and gives the file's logits."""
    cache, entry = _copy_cache(tiny, tmp_path, store=False)
    monkeypatch.setattr(gguf_convert, "WAIT_FOR_BUILDER_SECONDS", 0.5)
    with gguf_convert.building(entry / STORE, "spec"):
        lm = load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
        assert lm.converted and torch.equal(lm.model.forward_simple(IDS), tiny["logits"])
    assert _listing(entry) == sorted(["source.json", "tokenizer", "tokenizer-snapshot", STORE])


TWO_LOADS = """
import json, sys
from sgrt.models import load_model
import torch
lm = load_model(sys.argv[1], dtype="float32", cache_dir=sys.argv[2])
print(json.dumps({"converted": lm.converted, "path": str(lm.path),
                  "logits": lm.model.forward_simple(torch.tensor(json.loads(sys.argv[3]))).tolist()}))
"""


def test_two_processes_loading_one_uncached_model(tiny, tmp_path):
    """Two processes started together on an empty cache both load the model, with the file's
    logits, from one entry and one store (exactly one of them published the store), and leave no
    temporary folder."""
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-c", TWO_LOADS, str(tiny["gguf"]), str(cache), json.dumps(IDS.tolist())]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    loads = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(ld["converted"] for ld in loads) == [False, True]
    for ld in loads:
        assert torch.equal(torch.tensor(ld["logits"]), tiny["logits"])
    (entry,) = (cache / "gguf").iterdir()
    assert {ld["path"] for ld in loads} == {str(entry / STORE)}
    assert _listing(entry) == sorted(["source.json", "tokenizer", "tokenizer-snapshot", STORE])


def test_an_entry_published_by_another_process_while_this_one_builds_is_theirs(tiny, tmp_path, monkeypatch):
    """Two loads that build one entry at once (both found no builder): where the other publishes
    its entry while this one's child still runs, this one's folder, with the store its load packed
    meanwhile, loses the rename (not taken for a damaged entry to repair), and the load maps the
    other's store: not converted here, the file's logits (the race of the test above, made
    certain)."""
    cache = tmp_path / "cache"
    real = gguf_convert._run_child

    def other_publishes_meanwhile(gguf_path, tmp, spec, meanwhile):
        out = real(gguf_path, tmp, spec, meanwhile)
        final = cache / tiny["entry"].relative_to(tiny["cache"])
        shutil.copytree(tiny["entry"], final)  # (the other process's entry, store and all)
        return out

    monkeypatch.setattr(gguf_convert, "_run_child", other_publishes_meanwhile)
    lm = load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
    assert not lm.converted and lm.path == cache / tiny["entry"].relative_to(tiny["cache"]) / STORE
    assert torch.equal(lm.model.forward_simple(IDS), tiny["logits"])
    assert _listing(lm.path.parent) == sorted(["source.json", "tokenizer", "tokenizer-snapshot", STORE])


# ---- a full or read-only cache ---------------------------------------------------------------------------

def test_a_full_disk_while_packing_is_named_with_the_fix(tiny, tmp_path, monkeypatch):
    """No room for the store: a ModelLoadError names the store, the OS's reason and the fix, and
    the partial store is deleted."""
    cache, entry = _copy_cache(tiny, tmp_path, store=False)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
    msg = str(e.value)
    assert f"cannot write the weight store {entry / STORE}" in msg
    assert "No space left on device" in msg and "SGRT_CACHE_DIR" in msg
    assert _listing(entry) == ["source.json", "tokenizer", "tokenizer-snapshot"]


def _read_only(monkeypatch, root: Path) -> None:
    """Make every way sgrt writes files fail under ``root`` as a read-only filesystem does."""
    import builtins
    import io

    def under(path) -> bool:
        try:
            return Path(os.fsdecode(path)).resolve().is_relative_to(root.resolve())
        except (TypeError, ValueError):
            return False

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))

    real_open, real_os_open = builtins.open, os.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def open_(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+") and under(file):
            refuse(file)
        return real_open(file, mode, *a, **k)

    def os_open(path, flags, *a, **k):
        if flags & writes and under(path):
            refuse(path)
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)  # (pathlib's)
    monkeypatch.setattr(os, "open", os_open)
    for name in ("mkdir", "rmdir", "unlink", "remove"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda p, *a, _real=real, **k: refuse(p) if under(p) else _real(p, *a, **k))
    for name in ("rename", "replace"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda s, d, *a, _real=real, **k: refuse(s) if under(s) or under(d)
                            else _real(s, d, *a, **k))


def test_a_read_only_cache_loads_what_it_holds_and_names_the_fix_for_the_rest(tiny, tmp_path, monkeypatch):
    """A read-only cache: a load of what it holds writes nothing and gives the file's logits; a
    load that needs a new store raises a ModelLoadError naming the folder and SGRT_CACHE_DIR."""
    cache, entry = _copy_cache(tiny, tmp_path)
    before = _listing(entry)
    _read_only(monkeypatch, cache)
    with pytest.raises(OSError):  # (the simulation holds)
        (entry / "probe").write_text("")
    lm = load_model(str(tiny["gguf"]), dtype="float32", cache_dir=cache)
    assert not lm.converted and torch.equal(lm.model.forward_simple(IDS), tiny["logits"])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tiny["gguf"]), dtype="bfloat16", cache_dir=cache)
    msg = str(e.value)
    assert f"cannot write the cache {entry}" in msg and "Read-only file system" in msg and "SGRT_CACHE_DIR" in msg
    assert _listing(entry) == before
