"""Helpers shared by the constrained-decoding tests."""
from __future__ import annotations

import json

from sgrt.constrained import Grammar, allocate_token_bitmask
from sgrt.constrained.bitmask import allowed_tokens
from sgrt.engine.sampling_params import SamplingParams
from sgrt.errors import GrammarError

BACKENDS = ["llguidance", "outlines"]


def compile_or_refuse(compiler, backend: str, **constraint) -> Grammar | None:
    """The grammar, or None when the outlines backend refuses it with a GrammarError.

    llguidance must compile everything these tests give it; outlines-core may refuse (issue 5:
    "pass, or be refused with GrammarError by our own check"), never answer wrongly.
    """
    params = SamplingParams(grammar_backend=backend, **constraint)
    if backend == "outlines":
        try:
            return compiler.compile(params)
        except GrammarError:
            return None
    return compiler.compile(params)


def feed(grammar: Grammar, ids: list[int]) -> bool:
    """Accept ``ids`` one by one on a copy; True if all are taken and the grammar accepts."""
    g = grammar.copy()
    return all(g.accept_token(t) for t in ids) and g.is_accepting()


def encode_pieces(tokenizer, pieces: list[str]) -> list[int]:
    """Tokenize each piece on its own and concatenate: a non-canonical split of the text."""
    return [t for p in pieces for t in tokenizer.encode(p)]


def splits(tokenizer, text: str) -> list[list[int]]:
    """Several tokenizations of ``text``: canonical, one piece per character, and one that cuts
    before and after every backslash (so ``\\"`` and ``\\n`` are split apart)."""
    by_char = encode_pieces(tokenizer, list(text))
    cut: list[str] = []
    cur = ""
    for ch in text:
        if ch == "\\":
            if cur:
                cut.append(cur)
            cut.append(ch)
            cur = ""
        else:
            cur += ch
    if cur:
        cut.append(cur)
    return [tokenizer.encode(text), by_char, encode_pieces(tokenizer, cut)]


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def mask_of(grammar: Grammar, vocab_size: int) -> set[int]:
    bm = allocate_token_bitmask(1, vocab_size)
    grammar.fill_vocab_mask(bm, 0)
    return set(allowed_tokens(bm, 0, vocab_size))
