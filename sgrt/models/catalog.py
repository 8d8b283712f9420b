"""What is loadable here: the default model, packaged GGUFs, GGUFs in the cache, given paths.

``sgrt models [PATH ...]`` prints :func:`list_local_models`. Nothing is loaded: each entry is
checked by reading its ``config.json`` or GGUF metadata through the family registry
(:mod:`sgrt.models.registry`), so a listing costs milliseconds per entry (a GGUF's header only).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sgrt.errors import ModelLoadError
from sgrt.models.checkpoint import GGUFFile, _field, gguf_config, gguf_family, read_hf_config
from sgrt.models.gguf_convert import SOURCE_FILE
from sgrt.models.registry import family_for_hf
from sgrt.models.specs import DEFAULT_MODEL, GEMMA3_270M, default_gguf_path, packaged_gguf, resolve_spec
from sgrt.paths import cache_root


@dataclass
class ModelEntry:
    """One loadable (or refused) model.

    Attributes:
        spec: what to pass as ``model=`` / ``--model``.
        where: ``"default"``, ``"package"``, ``"cache"`` or ``"path"``.
        family: the family name (``"gemma3"``), or None when refused.
        detail: architecture and shape, or why it cannot be loaded.
        path: the file or folder it is read from ("" when there is none).
        size: bytes of its weights on disk (the GGUF file; an HF folder's safetensors).
    """

    spec: str
    where: str
    family: str | None
    detail: str
    path: str = ""
    size: int = 0


def _entry(spec: str, where: str, path: Path) -> ModelEntry:
    family, detail = describe(path)
    return ModelEntry(spec, where, family, detail, str(path), weight_bytes_on_disk(path))


def weight_bytes_on_disk(path: Path) -> int:
    """Bytes of a GGUF file, or of an HF folder's ``*.safetensors`` (0 for anything else)."""
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    except OSError:
        pass
    return 0


def describe(path: Path) -> tuple[str | None, str]:
    """``(family name or None, detail)`` of an HF folder / ``config.json`` / ``.gguf`` file."""
    try:
        kind, src = resolve_spec(str(path))
        if kind == "hf":
            config = read_hf_config(src, str(path))
            fam = family_for_hf({"architectures": [config.architecture]})
            return fam.name, _shape(config, "hf")
        reader = GGUFFile(src, str(path)).reader()
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
    out: list[ModelEntry] = []
    seen: set[Path] = set()
    p = default_gguf_path()
    if p is not None:
        out.append(_entry(DEFAULT_MODEL, "default", p))
        seen.add(p.resolve())
    try:
        p = packaged_gguf(GEMMA3_270M)
    except Exception:  # a broken chunk package must not break the listing
        p = None
    if p is not None:
        out.append(_entry(GEMMA3_270M, "package", p))
        seen.add(p.resolve())
    root = cache_root(cache_dir) / "gguf"
    for entry in sorted(root.glob(f"*/{SOURCE_FILE}")) if root.is_dir() else []:
        try:
            src = Path(json.loads(entry.read_text())["source"])
        except (OSError, ValueError, KeyError):
            continue
        if src.is_file() and src.resolve() not in seen:
            seen.add(src.resolve())
            out.append(_entry(str(src), "cache", src))
    for given in paths:
        out.append(_entry(given, "path", Path(given).expanduser()))
    return out
