"""A tokenizer as transformers built it, kept in sgrt's cache and read back without transformers.

Loading a tokenizer through ``transformers.AutoTokenizer`` costs ~0.7-1 s a load, nearly all of
it importing transformers' modules; its Rust ``tokenizers`` pipeline loads in ~0.1 s. So once
transformers has built a model's tokenizer (the source of truth: its class may rebuild the
pipeline from the files, and it renders chat templates), :func:`write_snapshot` keeps in a folder
of the cache entry:

- ``tokenizer.json``: the in-memory ``backend_tokenizer`` (``to_str``: what transformers'
  ``encode`` runs), not the source folder's file;
- ``facts.json``: what the wrapper reads from transformers (``len``, BOS / EOS ids, special and
  added tokens, the chat template, whether the tokenizer adds BOS), a stamp of the source folder's
  files and the installed transformers / tokenizers versions, and whether encode and decode through the
  bare pipeline gave transformers' ids and text on a probe corpus (:data:`PROBE_TEXTS`, every
  added token, each special token beside text). Where they did not, that call keeps going through
  transformers.

:func:`read_snapshot` returns a :class:`~sgrt.models.tokenizer.Tokenizer` over the pipeline, or
None where the snapshot is absent, unreadable or stale (the source files or the installed
transformers / tokenizers changed): the caller then loads through transformers and writes a new
one. The wrapper imports transformers the first time something needs it (``.hf``, a chat template
rendered, a call the probe did not clear).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Any

logger = logging.getLogger("sgrt.models")

SNAPSHOT_FORMAT = "sgrt-tokenizer-snapshot"
SNAPSHOT_VERSION = 1
# The snapshot's folder in a cache entry (a GGUF's ``gguf/<stem>-<key>/``, an HF folder's
# ``hf/<name>-<key>/``).
SNAPSHOT_DIR = "tokenizer-snapshot"
PIPELINE_FILE = "tokenizer.json"
FACTS_FILE = "facts.json"
# Files of a tokenizer folder that transformers does not read for the tokenizer (left out of the
# stamp: a model's weights beside its tokenizer in an HF folder).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".npz")

# Texts the pipeline must encode and decode as transformers does before the snapshot is used
# alone: spaces, newlines, digits, code, CJK (multi-token characters), emoji with joiners, RTL,
# combining marks, control characters, private-use and non-characters (byte fallback), and
# special-token text inside words.
PROBE_TEXTS = (
    "", " ", "Hello world", "  leading spaces,\ttabs\n\nand newlines\r\n", "trailing   ",
    "digits 12345 and 2024-11-30, 3.14159e-10", 'code: def f(x): return {"a": [1, 2.5e-3]}\n    pass',
    "人工智能 is AI; 日本語のテキスト; 한국어", "emoji: 😀🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "accents: café naïve Ærø ß", "combining: e\u0301 a\u0308 \u0915\u094d\u0937", "RTL: שלום مرحبا",
    "controls: \x00\x01\x07\x1b[0m\x7f", "private use \ue000\U000f0000 and \ufffe\uffff",
    "Ġthe Ċ ▁word <0x41> </s><s>", "<|im_start|>user\nHi<|im_end|>", "a<|endoftext|>b",
    "<start_of_turn>user\nhello<end_of_turn>\n", "<|begin_of_text|><|start_header_id|>x<|end_header_id|>",
)


def package_stamp() -> list[list[str | None]]:
    """``[name, version]`` of the installed transformers and tokenizers, from their
    ``.dist-info`` folders' names (neither is imported): another version makes every snapshot
    stale."""
    out: list[list[str | None]] = []
    for name in ("transformers", "tokenizers"):
        spec = find_spec(name)
        version = None
        if spec is not None and spec.submodule_search_locations:
            site = Path(list(spec.submodule_search_locations)[0]).parent
            prefix = f"{name}-"
            with os.scandir(site) as it:
                for e in it:
                    if e.name.startswith(prefix) and e.name.endswith(".dist-info"):
                        version = e.name[len(prefix):-len(".dist-info")]
                        break
        out.append([name, version])
    return out


def folder_stamp(folder: Path) -> list[list[Any]]:
    """``[name, size, mtime_ns]`` of each file of ``folder`` but weights (sorted by name): a
    tokenizer file written, replaced or added changes it."""
    rows = []
    with os.scandir(folder) as it:
        for e in it:
            if e.is_file() and not e.name.endswith(_WEIGHT_SUFFIXES):
                st = e.stat()
                rows.append([e.name, st.st_size, st.st_mtime_ns])
    return sorted(rows)


def _probe_texts(hf: Any) -> list[str]:
    added = [t.content for t in hf.added_tokens_decoder.values()]
    special = [t for t in (hf.all_special_tokens or []) if t]
    texts = list(PROBE_TEXTS)
    texts.append("".join(added))
    texts.append(" ".join(added))
    texts += [f"x{t}y {t}\n{t}" for t in special]
    return texts


def _encodes_alike(hf: Any, pipeline: Any, texts: list[str]) -> bool:
    for text in texts:
        for add in (False, True):
            try:
                if hf.encode(text, add_special_tokens=add) != pipeline.encode(text, add_special_tokens=add).ids:
                    return False
            except Exception:  # (a text one of them refuses: the other must refuse it too)
                return False
    return True


def _decodes_alike(hf: Any, pipeline: Any, texts: list[str], vocab_size: int) -> bool:
    rows = [hf.encode(t, add_special_tokens=False) for t in texts]
    rows.append(list(range(0, vocab_size, max(1, vocab_size // 4096))))
    rows.append(list(range(min(vocab_size, 512))))
    for ids in rows:
        for skip in (False, True):
            if hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) != \
                    pipeline.decode(ids, skip_special_tokens=skip):
                return False
    return True


def write_snapshot(hf: Any, source: Path, out: Path) -> bool:
    """Keep ``hf`` (a transformers fast tokenizer loaded from the folder ``source``) in the folder
    ``out`` (module docstring), written in a temporary sibling and renamed into place. Returns
    whether it was written: a cache that cannot be written (read-only, full) is not an error, the
    next load goes through transformers again.
    """
    from tokenizers import Tokenizer as Pipeline

    from sgrt.models.tokenizer import _decodes_with_backend

    try:
        pipeline = Pipeline.from_str(hf.backend_tokenizer.to_str())
        pipeline.no_truncation()
        pipeline.no_padding()
        texts = _probe_texts(hf)
        vocab_size = len(hf)
        bos = hf.bos_token_id
        facts = {
            "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION,
            "packages": package_stamp(), "source": str(source), "stamp": folder_stamp(source),
            "class": type(hf).__name__, "vocab_size": vocab_size,
            "bos_token_id": bos, "eos_token_id": hf.eos_token_id,
            "all_special_ids": [i for i in hf.all_special_ids if i is not None],
            "added": [[i, t.content, bool(t.special)] for i, t in sorted(hf.added_tokens_decoder.items())],
            "chat_template": getattr(hf, "chat_template", None),
            "adds_bos": bos is not None and hf.encode("a", add_special_tokens=True)[:1] == [bos]
            and hf.encode("a", add_special_tokens=False)[:1] != [bos],
            "encode": _encodes_alike(hf, pipeline, texts),
            "decode": _decodes_with_backend(type(hf)) and _decodes_alike(hf, pipeline, texts, vocab_size),
        }
    except Exception as e:  # (a tokenizer whose pipeline does not serialize: keep using transformers)
        logger.info("tokenizer of %s not kept for fast loads: %s: %s", source, type(e).__name__, e)
        return False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
        try:
            pipeline.save(str(tmp / PIPELINE_FILE))
            (tmp / FACTS_FILE).write_text(json.dumps(facts))
            umask = os.umask(0)
            os.umask(umask)
            for p in (tmp, tmp / PIPELINE_FILE, tmp / FACTS_FILE):
                os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
            if out.exists():
                from sgrt.models.cache_files import set_aside

                set_aside(out, str(source))
            os.rename(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # (OSError, or ModelLoadError from set_aside on a read-only cache)
        logger.info("tokenizer of %s not kept in %s: %s", source, out, e)
        return False
    return True


def read_facts(snapshot: Path, source: Path) -> dict[str, Any] | None:
    """``snapshot``'s facts where it is a whole snapshot of ``source`` as it is now, with the
    installed transformers and tokenizers; else None."""
    try:
        facts = json.loads((snapshot / FACTS_FILE).read_text())
        if not isinstance(facts, dict) or facts.get("format") != SNAPSHOT_FORMAT \
                or facts.get("version") != SNAPSHOT_VERSION:
            return None
        if facts.get("stamp") != folder_stamp(source) or facts.get("packages") != package_stamp():
            return None
        if not (snapshot / PIPELINE_FILE).is_file():
            return None
    except (OSError, ValueError):
        return None
    return facts


def read_snapshot(snapshot: Path, source: Path, extra_eos_token_ids: Any = ()) -> Any:
    """The :class:`~sgrt.models.tokenizer.Tokenizer` kept in ``snapshot`` for the tokenizer folder
    ``source``, or None where there is none that holds (:func:`read_facts`) or its pipeline does
    not load (transformers then loads ``source`` and the snapshot is written again)."""
    from sgrt.models.tokenizer import Tokenizer

    facts = read_facts(snapshot, source)
    if facts is None:
        return None
    try:
        from tokenizers import Tokenizer as Pipeline

        pipeline = Pipeline.from_file(str(snapshot / PIPELINE_FILE))
        return Tokenizer.from_pipeline(pipeline, facts, source, extra_eos_token_ids)
    except Exception as e:  # (a damaged file: the caller loads through transformers)
        logger.warning("tokenizer kept in %s does not load (%s: %s); loading %s with transformers", snapshot,
                       type(e).__name__, e, source)
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m sgrt.models.tokenizer_snapshot FOLDER OUT``: load the HF tokenizer folder
    ``FOLDER`` as :meth:`~sgrt.models.tokenizer.Tokenizer.from_folder` does
    (:func:`~sgrt.models.tokenizer.load_hf_tokenizer`) and write its snapshot to ``OUT``; exit
    status 0 where written, else 1.

    The loader runs it beside a cold load's packing of an HF folder's weights
    (:func:`sgrt.models.loader.load_model`). torch is hidden from it: transformers' config classes
    import torch's distributed modules (~1.5 of the ~2.4 s this takes with torch) only for model
    code, and transformers without torch builds the same tokenizer (``tests/models/
    test_tokenizer_snapshot.py`` compares the snapshots). Where it fails, the loading process
    loads the folder itself and reports what is wrong, as before.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    folder, out = Path(args[0]), Path(args[1])
    sys.modules["torch"] = None  # type: ignore[assignment]  (find_spec("torch") is then None)
    from sgrt.errors import ModelLoadError
    from sgrt.models.tokenizer import load_hf_tokenizer

    try:
        hf = load_hf_tokenizer(folder)
    except ModelLoadError as e:  # (the loading process loads it again and names the fault)
        print(e, file=sys.stderr)
        return 1
    return 0 if write_snapshot(hf, folder, out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
