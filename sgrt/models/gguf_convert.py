"""GGUF -> a cached HF-style folder (``config.json``, float32 ``model.safetensors``, tokenizer
files) under ``<cache root>/models/<stem>-<key>/``, where ``key`` is a digest of the file's
contents (:func:`gguf_cache_key`). The folder is built in a temporary sibling and renamed into
place, so readers never see a half-written one and two processes converting at once simply keep
the first.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import torch

from sgrt.errors import ModelLoadError
from sgrt.models.checkpoint import GGUFFile, family_config, gguf_hf_config, unpermute_rotary
from sgrt.paths import cache_root

# Bump when the conversion below changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
# Files up to this size are hashed whole (sha256 runs at ~0.5 GB/s: 0.2 s for the default model);
# larger ones by size plus 1 MiB samples at 16 evenly spaced offsets.
FULL_HASH_MAX_BYTES = 512 << 20
_MIB = 1 << 20

# GGUF tensors that carry rotary metadata rather than weights (read by the families' gguf_extras
# or gguf_config).
_GGUF_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# NOTE: tokenizers with this llama.cpp pre-tokenizer split every digit apart before byte-level
# BPE; transformers' GGUF tokenizer converter drops that step, so we put it back (it is what the
# original HF SmolLM2 tokenizer.json does: Digits(individual_digits) then ByteLevel).
_DIGIT_SPLIT_PRE_TOKENIZERS = {"smollm"}


def gguf_cache_key(path: Path) -> str:
    """A 16-hex-digit digest naming ``path``'s cache entry; any change to the file changes it.

    sha256 over the converter version, the size and the contents (whole file up to
    ``FULL_HASH_MAX_BYTES``; past that, 1 MiB at 16 evenly spaced offsets plus the last MiB).
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"sgrt-gguf-v{CONVERTER_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            while chunk := f.read(8 * _MIB):
                h.update(chunk)
        else:
            offsets = [size * i // 16 for i in range(16)] + [max(0, size - _MIB)]
            for off in offsets:
                f.seek(off)
                h.update(f.read(_MIB))
    return h.hexdigest()[:16]


def ensure_converted(gguf_path: Path, spec: str, cache_dir: str | Path | None = None,
                     source: GGUFFile | None = None) -> tuple[Path, bool]:
    """The cached HF folder for ``gguf_path``, converting it first if absent (``source``: the
    load's :class:`GGUFFile` of it, so that the conversion shares the load's one parse).

    Returns ``(folder, converted_now)``.

    Raises:
        ModelLoadError: unsupported architecture or tensor, or the cache dir is not writable.
    """
    root = cache_root(cache_dir) / "models"
    final = root / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"
    if (final / "sgrt_source.json").is_file():
        return final, False
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    except OSError as e:
        raise ModelLoadError(f"model {spec!r}: cannot write the conversion cache {root}: {e}"
                             " (set SGRT_CACHE_DIR to a writable folder)") from e
    try:
        from sgrt.progress import progress

        with progress(f"converting {gguf_path.name} (once; cached)"):
            convert_gguf(gguf_path, tmp, spec, source)
        _relax_permissions(tmp)
        (tmp / "sgrt_source.json").write_text(json.dumps({
            "source": str(gguf_path), "size": gguf_path.stat().st_size,
            "key": final.name.rsplit("-", 1)[-1], "converter_version": CONVERTER_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2))
        return final, publish_folder(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _relax_permissions(folder: Path) -> None:
    """Give a cache entry the usual umask-based modes (``mkdtemp`` and safetensors use 0o700 /
    0o600), so a cache shared between users stays readable."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def publish_folder(tmp: Path, final: Path) -> bool:
    """Atomically rename the finished ``tmp`` folder to ``final``.

    Returns True if ours was published, False if another process got there first (``tmp`` is
    then deleted and theirs kept). A stale ``final`` without ``sgrt_source.json`` (a crash from an
    older layout) is moved aside first.
    """
    if final.exists() and not (final / "sgrt_source.json").is_file():
        stale = final.with_name(f".stale-{final.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    try:
        os.rename(tmp, final)  # atomic on POSIX; fails if final exists and is non-empty
        return True
    except OSError:
        if (final / "sgrt_source.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise


def convert_gguf(gguf_path: Path, out: Path, spec: str, source: GGUFFile | None = None) -> None:
    """Write ``config.json``, ``model.safetensors`` (float32) and tokenizer files into ``out``.

    Every tensor type ``gguf`` dequantizes is read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q2_K..Q6_K, ...), in float32; names and layout follow the family (:mod:`sgrt.models.registry`).

    Raises:
        ModelLoadError: unreadable file, unsupported architecture or tensor.
    """
    import gguf
    from safetensors.torch import save_file

    reader = (source or GGUFFile(gguf_path, spec)).reader()
    hf_cfg, family, facts = gguf_hf_config(reader, spec)
    config = family_config(family, hf_cfg, spec, "the GGUF metadata")
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_TENSORS:
            continue
        name = family.gguf_hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} has no {family.name} counterpart")
        try:
            # NOTE: astype copies, which also detaches F32 tensors from the read-only memmap.
            w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        except NotImplementedError as e:
            raise ModelLoadError(f"model {spec!r}: GGUF tensor {t.name!r} has type "
                                 f"{t.tensor_type.name}, which gguf cannot dequantize: {e}") from e
        if family.gguf_unpermute_qk and t.name.endswith("attn_q.weight"):
            w = unpermute_rotary(w, config.num_attention_heads)
        elif family.gguf_unpermute_qk and t.name.endswith("attn_k.weight"):
            w = unpermute_rotary(w, config.num_key_value_heads)
        if family.gguf_norm_offset and t.name.endswith("norm.weight"):
            w = w - family.gguf_norm_offset
        state[name] = w.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, indent=2))
    _write_tokenizer(gguf_path, out, facts, spec)


def _write_tokenizer(gguf_path: Path, out: Path, facts: dict, spec: str) -> None:
    """Build the tokenizer with transformers from the GGUF and ``save_pretrained`` it to ``out``."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    try:
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
