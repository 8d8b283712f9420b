"""Reading a model's files without building it: GGUF metadata and HF ``config.json`` ->
:class:`ModelConfig` through the family registry (:mod:`sgrt.models.registry`), llama.cpp tensor
names and rotary layout (a checkpoint's tensors are read by :mod:`sgrt.models.weight_files`).

Used by the loader, the GGUF cache entries, the weight packer and the model listing; imports
none of them.
"""
from __future__ import annotations

import json
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
            ModelLoadError: the file cannot be parsed (names the file and the spec).
        """
        if self._reader is None:
            import gguf

            try:
                self._reader = gguf.GGUFReader(str(self.path))
            except Exception as e:  # gguf raises ValueError / struct.error on a corrupt file
                raise ModelLoadError(f"model {self.spec!r}: cannot read GGUF {self.path}: {e}") from e
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
        raise ModelLoadError(f"model {spec!r}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {supported_names()['gguf']})")
    return fam


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
        ModelLoadError: architecture not registered, or a rotary variant we do not read.
    """
    family = gguf_family(reader, spec)
    arch = _field(reader, "general.architecture")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    n_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else None
    eps = float(meta("attention.layer_norm_rms_epsilon", 1e-5))
    hf: dict[str, Any] = {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.hf_model_types[0],
        "vocab_size": int(meta("vocab_size", n_tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(f"{eps:.6g}"),  # stored as float32: 9.9999997e-06 -> 1e-05
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    window = meta("attention.sliding_window")
    if window:
        hf["sliding_window"] = int(window)
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        hf["partial_rotary_factor"] = rope_dim / head_dim
    scaling = meta("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": float(meta("rope.scaling.factor", 1.0))}
        original = meta("rope.scaling.original_context_length")
        if original:
            hf["rope_scaling"]["original_max_position_embeddings"] = int(original)
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


def family_config(family: Family, cfg: dict, spec: str, where: str) -> ModelConfig:
    """``cfg`` (an HF config dict) read by ``family``; ``where`` names its source in errors.

    Raises:
        ModelLoadError: a missing field or a value the family refuses.
    """
    try:
        config = family.config_from_hf(cfg)
    except KeyError as e:
        raise ModelLoadError(f"model {spec!r}: {where} lacks field {e}") from e
    except ValueError as e:
        raise ModelLoadError(f"model {spec!r}: {where}: {e}") from e
    config.architecture = family.hf_architectures[0]
    return config


def family_of(config: ModelConfig) -> Family:
    """The family a config was read by (from its ``architecture``)."""
    fam = family_for_hf({"architectures": [config.architecture]})
    if fam is None:
        raise ModelLoadError(f"architecture {config.architecture!r} has no registered family")
    return fam
