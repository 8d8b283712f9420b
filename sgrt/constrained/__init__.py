"""Constrained decoding: regex / JSON Schema / Lark grammars -> per-step token masks.

The engine uses :class:`GrammarCompiler` (one per engine) to turn a request's constraint into a
:class:`Grammar`, then each decode step: :meth:`Grammar.fill_vocab_mask` into a batch bitmask
from :func:`allocate_token_bitmask`, :func:`apply_token_bitmask_` on the logits, sample,
:meth:`Grammar.accept_token`; :meth:`Grammar.is_terminated` finishes the request, and
:meth:`Grammar.forced_tokens` feeds jump-forward. Backends: llguidance (default) and
outlines-core. See DESIGN.md ("Grammar object", "Jump-forward") and issue 5.
"""
from __future__ import annotations

from typing import Any

# NOTE: names are imported on first use: the bitmask and grammar modules import torch, which the
# command line's argument checks (limits, schema normalization) do not need.
_EXPORTS = {
    "allocate_token_bitmask": "sgrt.constrained.bitmask",
    "apply_token_bitmask_": "sgrt.constrained.bitmask",
    "BACKENDS": "sgrt.constrained.options",
    "GrammarCompiler": "sgrt.constrained.compiler",
    "grammar_files": "sgrt.constrained.lark_files",
    "load_grammar_text": "sgrt.constrained.lark_files",
    "dtype_regex": "sgrt.constrained.dtypes",
    "parse_dtype_value": "sgrt.constrained.dtypes",
    "CompiledGrammar": "sgrt.constrained.grammar",
    "Grammar": "sgrt.constrained.grammar",
    "fill_vocab_masks": "sgrt.constrained.grammar",
    "DEFAULT_MAX_STRING_LENGTH": "sgrt.constrained.options",
    "GrammarOptions": "sgrt.constrained.options",
    "load_schema": "sgrt.constrained.schema",
    "normalize_schema": "sgrt.constrained.schema",
}

__all__ = [
    "BACKENDS",
    "CompiledGrammar",
    "DEFAULT_MAX_STRING_LENGTH",
    "Grammar",
    "GrammarCompiler",
    "GrammarOptions",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "dtype_regex",
    "fill_vocab_masks",
    "grammar_files",
    "load_grammar_text",
    "load_schema",
    "normalize_schema",
    "parse_dtype_value",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sgrt.constrained' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
