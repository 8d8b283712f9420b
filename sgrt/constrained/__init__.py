"""Constrained decoding: regex / JSON Schema / Lark grammars -> per-step token masks.

The engine uses :class:`GrammarCompiler` (one per engine) to turn a request's constraint into a
:class:`Grammar`, then each decode step: :meth:`Grammar.fill_vocab_mask` into a batch bitmask
from :func:`allocate_token_bitmask`, :func:`apply_token_bitmask_` on the logits, sample,
:meth:`Grammar.accept_token`; :meth:`Grammar.is_terminated` finishes the request, and
:meth:`Grammar.forced_tokens` feeds jump-forward. Backends: llguidance (default) and
outlines-core. See DESIGN.md ("Grammar object", "Jump-forward") and issue 5.
"""
from sgrt.constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_
from sgrt.constrained.compiler import BACKENDS, GrammarCompiler, grammar_files, load_grammar_text
from sgrt.constrained.dtypes import dtype_regex, parse_dtype_value
from sgrt.constrained.grammar import CompiledGrammar, Grammar, fill_vocab_masks
from sgrt.constrained.options import DEFAULT_MAX_STRING_LENGTH, GrammarOptions
from sgrt.constrained.schema import load_schema, normalize_schema

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
