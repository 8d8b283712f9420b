"""Model code, weight loading and tokenization: ``load_model(spec) -> LoadedModel``.

Every name is imported on first use, so importing this package (or a light module in it, such as
:mod:`sgrt.models.catalog` behind ``sgrt models``) does not import torch or transformers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgrt.models.config import ModelConfig
    from sgrt.models.detokenizer import IncrementalDetokenizer
    from sgrt.models.layers import CausalLM
    from sgrt.models.llama import LlamaForCausalLM
    from sgrt.models.loader import DEFAULT_MODEL, LoadedModel, load_model, load_tokenizer
    from sgrt.models.tokenizer import Tokenizer

_EXPORTS = {
    "CausalLM": ("sgrt.models.layers", "CausalLM"),
    "LlamaForCausalLM": ("sgrt.models.layers", "CausalLM"),
    "DEFAULT_MODEL": ("sgrt.models.specs", "DEFAULT_MODEL"),
    "IncrementalDetokenizer": ("sgrt.models.detokenizer", "IncrementalDetokenizer"),
    "LoadedModel": ("sgrt.models.loader", "LoadedModel"),
    "ModelConfig": ("sgrt.models.config", "ModelConfig"),
    "Tokenizer": ("sgrt.models.tokenizer", "Tokenizer"),
    "load_model": ("sgrt.models.loader", "load_model"),
    "load_tokenizer": ("sgrt.models.loader", "load_tokenizer"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'sgrt.models' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(target[0]), target[1])
