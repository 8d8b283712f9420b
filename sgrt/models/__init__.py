"""Model code, weight loading and tokenization: ``load_model(spec) -> LoadedModel``.

The model code (``sgrt.models.layers``, shared by every family of ``sgrt.models.registry``) is
imported on first use, so importing this package stays cheap and works for code that needs only
the tokenizer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgrt.models.config import ModelConfig
from sgrt.models.detokenizer import IncrementalDetokenizer
from sgrt.models.loader import DEFAULT_MODEL, LoadedModel, load_model, load_tokenizer
from sgrt.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from sgrt.models.layers import CausalLM
    from sgrt.models.llama import LlamaForCausalLM

__all__ = [
    "CausalLM",
    "DEFAULT_MODEL",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "load_model",
    "load_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name in ("LlamaForCausalLM", "CausalLM"):
        from sgrt.models.layers import CausalLM

        return CausalLM
    raise AttributeError(f"module 'sgrt.models' has no attribute {name!r}")
