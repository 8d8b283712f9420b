"""What is loadable here: the default model, packaged GGUFs, GGUFs in the cache, given paths.

``sgrt models [PATH ...]`` prints :func:`list_local_models`. Nothing is loaded: a GGUF is
described from its key-value header alone (:mod:`sgrt.models.gguf_header`: architecture, shape,
file type, context, chat template; milliseconds, no tokenizer parse, no torch), its family found
by name (:mod:`sgrt.models.family_names`); what a family refuses beyond its architecture shows
at load. An HF folder is checked through its family (:mod:`sgrt.models.registry`), which reads
its ``config.json`` as a load does. :func:`chat_template_state` answers the CLI's question
before a load: does this model carry a chat template? Neither checks a packaged GGUF's sha256
(:func:`sgrt.models.specs.packaged_gguf` ``verify=False``): the load does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sgrt.errors import ModelLoadError
from sgrt.models.family_names import FAMILY_NAMES, family_of_gguf_arch, supported_architectures
from sgrt.models.gguf_header import read_gguf_header
from sgrt.models.specs import DEFAULT_MODEL, GEMMA3_270M, default_gguf_path, packaged_gguf, resolve_spec
from sgrt.paths import cache_root

# (gguf_convert.SOURCE_FILE, named here too: that module imports torch; a test keeps them equal)
SOURCE_FILE = "source.json"

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
        kind, src = resolve_spec(str(path), verify=False)
        if kind == "hf":
            return _describe_hf(src, str(path))
        return _describe_gguf(src, str(path))
    except ModelLoadError as e:
        return None, str(e)
    except Exception as e:  # a corrupt file: say so, keep listing
        return None, f"unreadable: {e}"


def _describe_gguf(src: Path, spec: str) -> tuple[str | None, str]:
    header = read_gguf_header(src)
    arch = header.architecture
    found = family_of_gguf_arch(arch)
    if found is None:
        return None, (f"model {spec!r}: GGUF architecture {arch!r} is not supported "
                      f"(supported: {supported_architectures()['gguf']})")
    family, hf_arch = found
    parts = [hf_arch, f"{header.arch_field('block_count')} layers", f"hidden {header.arch_field('embedding_length')}",
             f"vocab {header.vocab_size}", f"GGUF {header.file_type or 'file type not given'}",
             f"context {header.arch_field('context_length')}",
             "chat template" if header.has_chat_template else "no chat template"]
    return family, ", ".join(parts)


def _describe_hf(src: Path, spec: str) -> tuple[str | None, str]:
    from sgrt.models.checkpoint import read_hf_config
    from sgrt.models.registry import family_for_hf

    config = read_hf_config(src, spec)
    fam = family_for_hf({"architectures": [config.architecture]})
    template = "chat template" if _hf_has_chat_template(src) else "no chat template"
    return fam.name, (f"{config.architecture}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                      f"vocab {config.vocab_size}, HF, context {config.max_position_embeddings}, {template}")


def _hf_has_chat_template(folder: Path) -> bool:
    """Whether an HF folder carries a chat template (``tokenizer_config.json``'s
    ``chat_template``, or a ``chat_template.jinja`` / ``chat_template.json`` file)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def chat_template_state(spec: str) -> tuple[bool | None, str | None]:
    """``(has a chat template, family name)`` of a model spec, read as :func:`describe` reads
    it (no load); ``(None, None)`` when the spec cannot be read here (the load then says why).
    """
    try:
        kind, src = resolve_spec(spec, verify=False)
        if kind == "hf":
            cfg = json.loads((src / "config.json").read_text())
            archs = cfg.get("architectures") or []
            family = next((name for name, hf, _ in FAMILY_NAMES if archs and archs[0] in hf), None)
            return _hf_has_chat_template(src), family
        header = read_gguf_header(src)
        found = family_of_gguf_arch(header.architecture)
        return header.has_chat_template, found[0] if found else None
    except Exception:  # noqa: BLE001 - unreadable here: the load reports it properly
        return None, None


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
        p = packaged_gguf(GEMMA3_270M, verify=False)
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
