"""Reading a model's files without building it: GGUF metadata and HF ``config.json`` ->
:class:`ModelConfig` through the family registry (:mod:`sgrt.models.registry`), llama.cpp tensor
names and rotary layout (a checkpoint's tensors are read by :mod:`sgrt.models.weight_files`).

Used by the loader, the GGUF cache entries, the weight packer and the model listing; imports
none of them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from sgrt.errors import ModelLoadError
from sgrt.models.config import ModelConfig
from sgrt.models.registry import Family, family_for_gguf, family_for_hf, supported_names


class GGUFFile:
    """One GGUF file, parsed at most once: :meth:`reader` opens a ``gguf.GGUFReader`` on its first
    call and returns the same reader after.

    A first load of a GGUF reads it three times (the float conversion, the 4-bit blocks, the 8-bit
    blocks); one ``GGUFFile`` for the whole load makes that one parse (~27 s for Gemma 3's
    262,144-token vocabulary on the 2-core EPYC), and none when every cache is warm. Meant to live
    as long as one load: the parsed metadata of such a vocabulary holds ~700 MB.
    """

    def __init__(self, path: str | Path, spec: str = "") -> None:
        self.path = Path(path)
        self.spec = spec
        self._reader: Any = None

    def reader(self) -> Any:
        """The file's ``gguf.GGUFReader`` (parsed now if not yet).

        Raises:
            ModelLoadError: the file cannot be parsed (names the file, the spec and what is wrong:
                :func:`~sgrt.models.gguf_check.gguf_layout_problem`).
        """
        if self._reader is None:
            import gguf

            from sgrt.models.gguf_check import gguf_layout_problem

            try:
                self._reader = gguf.GGUFReader(str(self.path))
            except Exception as e:  # (numpy's and struct's errors deep in gguf on a damaged file)
                try:
                    why = gguf_layout_problem(self.path)
                except OSError as oe:
                    why = str(oe)
                raise ModelLoadError(f"model {self.spec!r}: cannot read GGUF {self.path}: "
                                     f"{why or f'{type(e).__name__}: {e}'}") from e
        return self._reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_family(reader: Any, spec: str) -> Family:
    """The family of an open GGUF (by ``general.architecture``).

    Raises:
        ModelLoadError: no registered family reads it (the message lists those that do).
    """
    arch = _field(reader, "general.architecture")
    fam = family_for_gguf(arch)
    if fam is None:
        raise ModelLoadError(f"model {spec!r}: GGUF architecture {arch!r} of {gguf_name(reader, spec)} is not "
                             f"supported (supported: {supported_names()['gguf']})")
    return fam


def gguf_name(reader: Any, spec: str) -> str:
    """The path of an open GGUF (``spec`` where the reader does not know it), for messages."""
    return getattr(getattr(reader, "data", None), "filename", None) or spec


def hf_name(gguf_name: str, family: Family | None = None) -> str | None:
    """llama.cpp tensor name -> HF parameter name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``) in ``family``'s naming (default Llama); None if
    unknown."""
    if family is None:
        family = family_for_gguf("llama")
    return family.gguf_hf_name(gguf_name)


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate-half halves).

    llama.cpp's converter maps HF rows ``[head, half, i]`` to ``[head, i, half]`` (pairs
    ``(x_i, x_{i+d/2})`` made adjacent); this is the inverse. ``w``: ``[n_heads * head_dim, in]``;
    ``n_heads``: query heads for ``attn_q``, key/value heads for ``attn_k``.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_hf_config(reader: Any, spec: str) -> tuple[dict, Family, dict]:
    """An HF ``config.json`` dict in the family's own format, the family, and a dict of
    tokenizer facts, from GGUF metadata.

    Raises:
        ModelLoadError: architecture not registered, a rotary variant we do not read, or a shape
            field missing or not a positive integer (names the key and the file).
    """
    family = gguf_family(reader, spec)
    arch = _field(reader, "general.architecture")
    where = f"the GGUF metadata of {gguf_name(reader, spec)}"

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    def count(key: str, default: int | None = None) -> int:
        """``<arch>.<key>``, a positive integer (``default`` where absent)."""
        v = meta(key, default)
        if v is None:
            raise ModelLoadError(f"model {spec!r}: {where} lacks {arch}.{key}")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelLoadError(f"model {spec!r}: {where} has {arch}.{key} = {v!r}, not a positive integer")
        return v

    def number(key: str, default: float) -> float:
        """``<arch>.<key>``, a finite number (``default`` where absent)."""
        v = meta(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ModelLoadError(f"model {spec!r}: {where} has {arch}.{key} = {v!r}, not a number")
        return float(v)

    tensors = {t.name: t for t in reader.tensors}
    n_heads = count("attention.head_count")
    hidden = count("embedding_length")
    if meta("attention.key_length") is None and hidden % n_heads:
        raise ModelLoadError(f"model {spec!r}: {where} has {arch}.embedding_length = {hidden}, not a multiple of "
                             f"{arch}.attention.head_count = {n_heads}, and no {arch}.attention.key_length")
    head_dim = count("attention.key_length", hidden // n_heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else None
    eps = number("attention.layer_norm_rms_epsilon", 1e-5)
    hf: dict[str, Any] = {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.hf_model_types[0],
        "vocab_size": count("vocab_size", n_tokens),
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length"),
        "num_hidden_layers": count("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": count("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "max_position_embeddings": count("context_length", 2048),
        "rms_norm_eps": float(f"{eps:.6g}"),  # stored as float32: 9.9999997e-06 -> 1e-05
        "rope_theta": number("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if meta("attention.sliding_window"):
        hf["sliding_window"] = count("attention.sliding_window")
    rope_dim = count("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        hf["partial_rotary_factor"] = rope_dim / head_dim
    scaling = meta("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": number("rope.scaling.factor", 1.0)}
        if meta("rope.scaling.original_context_length"):
            hf["rope_scaling"]["original_max_position_embeddings"] = count("rope.scaling.original_context_length")
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"model {spec!r}: GGUF rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in tensors:
        # NOTE: llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors.
        import gguf
        import numpy as np

        t = tensors["rope_freqs.weight"]
        freq = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).ravel()
        hf["rope_scaling"] = {"rope_type": "default", "freq_factors": freq.tolist()}
    family.gguf_extras(hf, meta, tensors)
    facts = {"pre": _field(reader, "tokenizer.ggml.pre"),
             "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
             "chat_template": _field(reader, "tokenizer.chat_template")}
    return hf, family, facts


def gguf_config(reader: Any, spec: str) -> tuple[ModelConfig, dict]:
    """``ModelConfig`` and a dict of tokenizer facts from GGUF metadata (:func:`gguf_hf_config`).

    Raises:
        ModelLoadError: as :func:`gguf_hf_config`, or the family refuses the config.
    """
    hf, family, facts = gguf_hf_config(reader, spec)
    return family_config(family, hf, spec, "the GGUF metadata"), facts


# ---- HF folders --------------------------------------------------------------------------------

def read_hf_config(folder: Path, spec: str) -> ModelConfig:
    """Read ``folder/config.json`` through its family (:mod:`sgrt.models.registry`).

    Raises:
        ModelLoadError: missing or unreadable, no registered family, or a feature the family does
            not implement (the message names it).
    """
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model {spec!r}: cannot read {path}: {e}") from e
    family = family_for_hf(cfg)
    if family is None:
        raise ModelLoadError(f"model {spec!r}: architecture {cfg.get('architectures') or cfg.get('model_type')!r} "
                             f"(model_type {cfg.get('model_type')!r}) in {path} is not supported; "
                             f"supported: {supported_names()['hf']}")
    return family_config(family, cfg, spec, str(path))


# ModelConfig's sizes, each a positive integer in any model
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim")


def family_config(family: Family, cfg: dict, spec: str, where: str) -> ModelConfig:
    """``cfg`` (an HF config dict) read by ``family``; ``where`` names its source in errors.

    Raises:
        ModelLoadError: a missing field, a value the family refuses, or a shape no model has (a
            size that is not a positive integer, query heads not a multiple of key / value heads;
            names the field).
    """
    try:
        config = family.config_from_hf(cfg)
    except KeyError as e:
        raise ModelLoadError(f"model {spec!r}: {where} lacks field {e}") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"model {spec!r}: {where}: {e}") from e
    for name in _SHAPE_FIELDS:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelLoadError(f"model {spec!r}: {where} has {name} = {v!r}, not a positive integer")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ModelLoadError(f"model {spec!r}: {where} has num_attention_heads = {config.num_attention_heads}, not a "
                             f"multiple of num_key_value_heads = {config.num_key_value_heads}")
    config.architecture = family.hf_architectures[0]
    return config


def family_of(config: ModelConfig) -> Family:
    """The family a config was read by (from its ``architecture``)."""
    fam = family_for_hf({"architectures": [config.architecture]})
    if fam is None:
        raise ModelLoadError(f"architecture {config.architecture!r} has no registered family")
    return fam
