"""A GGUF's tokenizer, built by transformers from the file's vocabulary: the ``tokenizer/`` folder
of its cache entry (:mod:`sgrt.models.gguf_convert`) and sgrt's snapshot of it
(:mod:`sgrt.models.tokenizer_snapshot`).

It runs in a child process of the loading one (``python -m sgrt.models.gguf_tokenizer``), beside
the load's packing of the weights, and it imports no torch where it can help it: transformers'
``AutoTokenizer`` imports torch (its config classes do) and builds the model's config only to
choose the tokenizer class, and transformers' GGUF metadata reader imports torch too. That was
~2.7 s of the child's ~4 s on a 1B GGUF (2-core EPYC), on the cold load's critical path. So:

- the class is the one :data:`TOKENIZER_CLASSES` names for the family's HF ``model_type``
  (``AutoTokenizer``'s choice for a GGUF with no ``tokenizer_config.json`` beside it, under
  transformers 5; a test holds the table to the installed transformers' mapping);
- while that class's ``from_pretrained(gguf_file=...)`` reads the file, transformers' reader
  module is a stand-in whose ``read_gguf_metadata`` gives the same values from our own walk of
  the header (:func:`transformers_metadata`).

Elsewhere (transformers 4, a model type not in the table, a ``tokenizer_config.json`` beside the
file, a file our walk leaves) ``AutoTokenizer`` builds it, with gguf's reader replaced by :class:`MetadataValuesReader`
(what transformers 4 parses the vocabulary with; :func:`_tokenizer_reader`).
"""
from __future__ import annotations

import json
import struct
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from sgrt.errors import ModelLoadError
from sgrt.models.gguf_header import _ARRAY, _SCALARS, _STRING

# The tokenizer class transformers 5's AutoTokenizer builds for a GGUF of each HF model_type sgrt
# loads (its TOKENIZER_MAPPING_NAMES; a model type it does not list gets TokenizersBackend, and
# Mistral's MistralCommonBackend is TokenizersBackend without mistral-common's files).
TOKENIZER_CLASSES = {
    "llama": "TokenizersBackend", "mistral": "TokenizersBackend", "phi3": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
    "gemma3": "GemmaTokenizer", "gemma3_text": "GemmaTokenizer",
}
# NOTE: tokenizers with this llama.cpp pre-tokenizer split every digit apart before byte-level
# BPE; transformers' GGUF tokenizer converter drops that step, so we put it back (it is what the
# original HF SmolLM2 tokenizer.json does: Digits(individual_digits) then ByteLevel).
_DIGIT_SPLIT_PRE_TOKENIZERS = {"smollm"}
TOKENIZER_DIR = "tokenizer"
# The module of transformers' GGUF metadata reader (imports torch), stood in for while the
# tokenizer reads the file.
_TRANSFORMERS_READER = "transformers.integrations.gguf.reader"


def write_tokenizer_parts(gguf_path: Path, out: Path, facts: dict, hf_config: dict, spec: str) -> None:
    """Write a cache entry's tokenizer parts into the folder ``out``: ``tokenizer/``
    (:func:`write_tokenizer`, with ``generation_config.json`` holding ``hf_config``'s BOS / EOS
    ids) and the snapshot (:func:`write_tokenizer_snapshot`).

    Raises:
        ModelLoadError: as :func:`write_tokenizer`.
    """
    from sgrt.models.tokenizer_snapshot import SNAPSHOT_DIR

    tok = out / TOKENIZER_DIR
    write_tokenizer(gguf_path, tok, facts, spec, hf_config.get("model_type"))
    (tok / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": hf_config.get("bos_token_id"), "eos_token_id": hf_config.get("eos_token_id")}, indent=2))
    write_tokenizer_snapshot(tok, out / SNAPSHOT_DIR)


def write_tokenizer(gguf_path: Path, out: Path, facts: dict, spec: str, model_type: str | None = None) -> None:
    """Build ``gguf_path``'s tokenizer with transformers and ``save_pretrained`` it to ``out``
    (the class :data:`TOKENIZER_CLASSES` names for ``model_type``, else ``AutoTokenizer``'s),
    with llama.cpp's digit split put back, the chat template from ``facts``
    (``gguf_hf_config``'s tokenizer facts: ``pre``, ``add_bos_token``, ``chat_template``) where the
    converter left none, and the loader-only keys dropped from ``tokenizer_config.json``.

    Raises:
        ModelLoadError: transformers cannot build a tokenizer from the file (its message).
    """
    from tokenizers import pre_tokenizers

    try:
        tok = _built_directly(gguf_path, model_type)
        if tok is None:
            from transformers import AutoTokenizer

            with _tokenizer_reader():
                tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"model {spec!r}: cannot build a tokenizer from {gguf_path}: {e}") from e
    if facts.get("pre") in _DIGIT_SPLIT_PRE_TOKENIZERS:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if facts.get("chat_template") and not getattr(tok, "chat_template", None):
        tok.chat_template = facts["chat_template"]
    tok.save_pretrained(str(out))
    # NOTE: drop loader-only keys transformers writes back, so the folder reads like a hub one.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("is_local", "local_files_only", "gguf_file", "name_or_path"):
        cfg.pop(k, None)
    cfg["clean_up_tokenization_spaces"] = False
    cfg["add_bos_token"] = facts.get("add_bos_token", False)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def write_tokenizer_snapshot(folder: Path, out: Path) -> None:
    """Load the tokenizer just written to ``folder`` as a load would (transformers: the class its
    ``tokenizer_config.json`` names, which is what ``AutoTokenizer`` loads from such a folder) and
    keep it in ``out`` (:mod:`sgrt.models.tokenizer_snapshot`), so that loads read it without
    transformers."""
    from sgrt.models.tokenizer_snapshot import write_snapshot

    name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    cls = _tokenizer_class(name) if name in TOKENIZER_CLASSES.values() else None
    if cls is None:
        from transformers import AutoTokenizer as cls  # type: ignore[no-redef]
    write_snapshot(cls.from_pretrained(str(folder), local_files_only=True), folder, out)


def _tokenizer_class(name: str) -> Any:
    """transformers' tokenizer class ``name`` (a top-level name of transformers 5: imports no
    torch), or None where this transformers has none (transformers 4)."""
    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError):
        return None


def _built_directly(gguf_path: Path, model_type: str | None) -> Any:
    """``gguf_path``'s tokenizer built by the class :data:`TOKENIZER_CLASSES` names for
    ``model_type``, the file's metadata read by :func:`transformers_metadata`; None where this
    path does not apply (module docstring) or that reader leaves the file, and ``AutoTokenizer``
    builds it (and names what is wrong with it as before)."""
    name = TOKENIZER_CLASSES.get(model_type or "")
    if name is None or (gguf_path.parent / "tokenizer_config.json").exists():
        return None
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping  # noqa: F401 (transformers 5's converter)
    except ImportError:
        return None
    cls = _tokenizer_class(name)
    if cls is None:
        return None
    from sgrt.models.gguf_layout import NotReadHere

    stand_in = types.ModuleType(_TRANSFORMERS_READER)
    stand_in.read_gguf_metadata = transformers_metadata  # type: ignore[attr-defined]
    real = sys.modules.get(_TRANSFORMERS_READER)  # (imported already where torch is: a test)
    sys.modules[_TRANSFORMERS_READER] = stand_in
    try:
        return cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    except NotReadHere:  # (a file our walk leaves: a repeated key, an array of arrays; AutoTokenizer reads it)
        return None
    finally:
        if real is None:
            sys.modules.pop(_TRANSFORMERS_READER, None)
        else:
            sys.modules[_TRANSFORMERS_READER] = real


def transformers_metadata(gguf_path: str | Path, string_arrays: Any = ()) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``(metadata, tensor names)`` of a GGUF as transformers 5's ``read_gguf_metadata`` returns
    them: every key's value as a Python value (a string as ``str``, a number as ``int`` /
    ``float`` / ``bool``, an array of numbers as a list), an array of strings as its list where its
    key is in ``string_arrays`` and else as its length; the tensors' names in file order.

    Raises:
        ValueError: the file has no ``general.architecture`` (as transformers' reader).
        NotReadHere: a file the layout reader leaves (big-endian, damaged), an array of arrays.
        OSError: the file cannot be read.
    """
    reader = MetadataValuesReader(gguf_path)
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # (the reader's header fields, as gguf's reader puts them)
            continue
        if field.types[0] == _STRING:
            metadata[key] = field.parts[0].decode("utf-8")
        elif field.types[0] != _ARRAY:
            metadata[key] = field.parts[0][0].item()
        elif field.types[1] != _STRING:
            metadata[key] = field.parts.ravel().tolist()
        else:
            metadata[key] = [b.decode("utf-8") for b in field.parts] if key in string_arrays else len(field.parts)
    if "general.architecture" not in metadata:
        raise ValueError(f"{gguf_path} has no `general.architecture` in its metadata.")
    return metadata, tuple(t.name for t in reader.tensors)


@contextmanager
def _plain_gguf_maps() -> Iterator[None]:
    """While the block runs, ``gguf.GGUFReader`` maps its file as a plain ``numpy.ndarray``
    (a view of the same ``numpy.memmap``), not as the ``memmap`` subclass: its parse slices the
    map once per value, and the subclass's ``__getitem__`` / ``__array_finalize__`` were more
    than half of the parse (llama-1b's 49k-token vocabulary: 2.3 s of CPU -> 1.0 s, the same
    fields). For the entry's child process only (transformers parses the file there).
    """
    import numpy as np
    from gguf import gguf_reader

    class PlainMaps:
        def __getattr__(self, name: str) -> Any:
            return getattr(np, name)

        @staticmethod
        def memmap(*args: Any, **kwargs: Any) -> Any:
            return np.memmap(*args, **kwargs).view(np.ndarray)

    saved = gguf_reader.np
    gguf_reader.np = PlainMaps()
    try:
        yield
    finally:
        gguf_reader.np = saved


# GGUF value types (gguf's GGUFValueType) of fixed size -> their numpy dtype, as gguf reads them
# (the header reader's struct formats, little-endian)
_VALUE_DTYPES = {kind: "<" + fmt for kind, fmt in _SCALARS.items()}


class ValuesField:
    """One metadata field as transformers' GGUF loader reads a ``gguf`` ``ReaderField``: its value
    ``i`` is ``parts[i]`` for ``i`` in ``data``, parsed by ``types`` (``[type]``, or ``[ARRAY,
    item type]``); a string's value is its UTF-8 bytes, a number's a one-item numpy array of its
    type (gguf's parts hold the same bytes and numbers, beside the key's and the length prefixes)."""

    __slots__ = ("types", "parts", "data")

    def __init__(self, types: list[int], parts: Any) -> None:
        self.types = types
        self.parts = parts
        self.data = range(len(parts))


class MetadataValuesReader:
    """The metadata values and tensor names of a GGUF, read for transformers' tokenizer in place of
    ``gguf.GGUFReader`` (what ``load_gguf_checkpoint`` reads of it: ``fields`` in file order, each
    a :class:`ValuesField`, and ``tensors`` with their names), without a numpy view per value:
    gguf's parse builds three for every token of a vocabulary (~0.9 s of CPU for a 49k-token one;
    this reads it in ~0.05 s). The file is checked as :func:`~sgrt.models.gguf_layout.read_layout`
    checks it.

    Raises:
        NotReadHere: a file the layout reader leaves (big-endian, damaged), or an array of arrays:
            the caller parses with gguf's reader.
        OSError: the file cannot be read.
    """

    def __init__(self, path: str | Path) -> None:
        from sgrt.models.gguf_layout import read_layout

        layout = read_layout(path)
        self.tensors = layout.tensors
        self.data_offset = layout.data_offset
        with open(path, "rb") as f:
            head = f.read(layout.data_offset)
        self.fields = _metadata_values(head)


def _metadata_values(head: bytes) -> dict[str, ValuesField]:
    """The key-value fields of a little-endian GGUF whose metadata is ``head`` (already checked by
    the layout reader), as :class:`ValuesField`, after the three gguf's reader puts first
    (``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``). A repeated key raises
    NotReadHere (gguf's reader refuses it, and says so)."""
    import numpy as np

    from sgrt.models.gguf_layout import NotReadHere

    u32, u64 = struct.Struct("<I").unpack_from, struct.Struct("<Q").unpack_from
    n_kv = u64(head, 16)[0]
    pos = 24
    fields: dict[str, ValuesField] = {
        "GGUF.version": ValuesField([4], [np.frombuffer(head, "<u4", 1, 4)]),
        "GGUF.tensor_count": ValuesField([10], [np.frombuffer(head, "<u8", 1, 8)]),
        "GGUF.kv_count": ValuesField([10], [np.frombuffer(head, "<u8", 1, 16)]),
    }
    for _ in range(n_kv):
        n = u64(head, pos)[0]
        key = head[pos + 8:pos + 8 + n].decode("utf-8")
        pos += 8 + n
        kind = u32(head, pos)[0]
        pos += 4
        if kind == _ARRAY:
            item, count = u32(head, pos)[0], u64(head, pos + 4)[0]
            pos += 12
            types = [_ARRAY, item]
            if item == _STRING:
                parts: Any = []
                append = parts.append
                for _ in range(count):
                    n = u64(head, pos)[0]
                    append(head[pos + 8:pos + 8 + n])
                    pos += 8 + n
            elif item in _VALUE_DTYPES:
                dtype = np.dtype(_VALUE_DTYPES[item])
                parts = np.frombuffer(head, dtype, count, pos).reshape(count, 1)
                pos += dtype.itemsize * count
            else:
                raise NotReadHere(f"{key}: an array of value type {item}")
        elif kind == _STRING:
            n = u64(head, pos)[0]
            types, parts = [kind], [head[pos + 8:pos + 8 + n]]
            pos += 8 + n
        elif kind in _VALUE_DTYPES:
            dtype = np.dtype(_VALUE_DTYPES[kind])
            types, parts = [kind], [np.frombuffer(head, dtype, 1, pos)]
            pos += dtype.itemsize
        else:
            raise NotReadHere(f"{key}: value type {kind}")
        if key in fields:
            raise NotReadHere(f"{key}: repeated")
        fields[key] = ValuesField(types, parts)
    return fields


@contextmanager
def _tokenizer_reader() -> Iterator[None]:
    """While the block runs, ``gguf.GGUFReader`` (what transformers' GGUF loader opens) is
    :class:`MetadataValuesReader`, or gguf's own reader over a plain map (:func:`_plain_gguf_maps`)
    for a file that one leaves. For the entry's child process only."""
    import gguf

    from sgrt.models.gguf_layout import NotReadHere

    real = gguf.GGUFReader

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            try:
                return MetadataValuesReader(path)
            except NotReadHere:
                pass
        with _plain_gguf_maps():
            return real(path, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def run_child(work: Callable[[], None], path: Path, out: Path, spec: str) -> int:
    """Run a cache entry's child ``work`` (reading ``path`` into the folder ``out``): exit status 0,
    or 1 with the error's message as the last stdout line, JSON ``{"error": ...}`` (what
    :func:`sgrt.models.gguf_convert.ensure_gguf_source` raises): a ModelLoadError's own, a cache
    that cannot be written, a file that cannot be read, or anything else with its traceback on
    stderr."""
    from sgrt.models.cache_files import CACHE_FULL_ERRNOS

    try:
        work()
    except ModelLoadError as e:
        error = str(e)
    except OSError as e:
        if e.errno in CACHE_FULL_ERRNOS or (e.filename and str(e.filename).startswith(str(out))):
            error = (f"model {spec!r}: cannot write the cache entry of {path} in {out.parent}: {e} (free space "
                     f"there, or set SGRT_CACHE_DIR to a writable folder with room)")
        else:
            error = f"model {spec!r}: cannot read {path}: {e}"
    except Exception as e:  # (a fault of the file that no check above names; the traceback for us)
        import traceback

        traceback.print_exc()
        error = f"model {spec!r}: reading GGUF {path} failed: {type(e).__name__}: {e}"
    else:
        return 0
    print(json.dumps({"error": error}))
    return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m sgrt.models.gguf_tokenizer GGUF OUT SPEC``, with ``{"facts": ..., "hf_config":
    ...}`` as JSON on stdin (the file's tokenizer facts and HF config, as the loading process read
    them): :func:`write_tokenizer_parts` into ``OUT``, under :func:`run_child`."""
    args = sys.argv[1:] if argv is None else argv
    path, out, spec = Path(args[0]), Path(args[1]), args[2]
    try:  # (transformers' imports first: the loading process reads the metadata meanwhile)
        import transformers.tokenization_utils_tokenizers  # noqa: F401
        from transformers.integrations.gguf import gguf_tokenizer_mapping  # noqa: F401
    except ImportError:  # (transformers 4: AutoTokenizer imports what it needs)
        pass
    given = json.load(sys.stdin)
    return run_child(lambda: write_tokenizer_parts(path, out, given["facts"], given["hf_config"], spec),
                     path, out, spec)


if __name__ == "__main__":
    sys.exit(main())
