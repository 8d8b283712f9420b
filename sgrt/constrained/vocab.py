"""The token vocabulary as the grammar backends see it: raw bytes per id, EOS ids, special ids.

Both backends build their token tables from each token's *raw bytes* (byte-level BPE: ``Ġ`` is
0x20, a token holding half of a UTF-8 character stays those bytes), never from decoded strings,
which lose partial characters. The mask width is the model's logits width (``vocab_size``), which
may exceed the tokenizer's length: ids past the tokenizer have no bytes and are always forbidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sgrt.errors import GrammarError
from sgrt.models.tokenizer import Tokenizer

# GPT-2 byte-level BPE table, reversed (printable character -> byte). Used only when the
# tokenizer object offers no ``all_token_bytes()``.
def _unicode_to_bytes() -> dict[str, int]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


@dataclass
class Vocab:
    """What a grammar backend needs to know about the tokenizer.

    Attributes:
        token_bytes: raw bytes of each id, ``len == vocab_size`` (the logits width); ids past the
            tokenizer are ``b""``. Special tokens hold their UTF-8 text.
        vocab_size: the mask width in tokens (the model's logits width).
        n_tokenizer: how many ids the tokenizer itself has (``<= vocab_size``).
        eos_token_ids: ids that end generation (EOS and end-of-turn tokens), sorted.
        special_token_ids: control tokens; a grammar never produces them (EOS aside).
        encode: text -> ids with no special tokens added (canonical tokenization for
            jump-forward).
    """

    token_bytes: list[bytes]
    vocab_size: int
    n_tokenizer: int
    eos_token_ids: list[int]
    special_token_ids: set[int]
    encode: Callable[[str], list[int]]

    @property
    def eos_token_id(self) -> int:
        """The primary EOS id (the tokenizer's own EOS when it has one)."""
        return self.eos_token_ids[0]

    def is_forbidden(self, token_id: int) -> bool:
        """True for ids a grammar can never produce: past the tokenizer, empty, or special
        (EOS ids are handled apart)."""
        return (
            token_id < 0
            or token_id >= self.n_tokenizer
            or token_id in self.special_token_ids
            or not self.token_bytes[token_id]
        )


def build_vocab(tokenizer: Any, vocab_size: int) -> Vocab:
    """Read a :class:`Vocab` from ``tokenizer``.

    ``tokenizer`` is anything that offers ``.hf`` (a transformers fast tokenizer) and, preferably,
    ``eos_token_ids`` and ``all_token_bytes()`` (as ``sgrt.models.Tokenizer`` does); a bare
    transformers fast tokenizer also works (bytes are then read back through GPT-2's byte table).

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the logits width; must be >= 1. Tokenizer ids at or past it are dropped.

    Raises:
        GrammarError: the tokenizer has no EOS id, or ``vocab_size`` is not positive.
    """
    if vocab_size <= 0:
        raise GrammarError(f"vocab_size must be >= 1, got {vocab_size}")
    if isinstance(tokenizer, Tokenizer):
        # (its own facts: its transformers tokenizer may not be loaded, and need not be)
        raw = list(tokenizer.all_token_bytes())
        special = set(tokenizer.special_token_ids)
        eos, primary = tokenizer.eos_token_ids, tokenizer.eos_token_id

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text)
    else:
        hf = getattr(tokenizer, "hf", tokenizer)
        if hasattr(tokenizer, "all_token_bytes"):
            raw = list(tokenizer.all_token_bytes())
        else:
            raw = _bytes_from_hf(hf)
        special = set(getattr(tokenizer, "special_token_ids", None) or ())
        special |= {i for i in (getattr(hf, "all_special_ids", None) or ()) if i is not None}
        added = getattr(hf, "added_tokens_decoder", None) or {}
        special |= {i for i, t in added.items() if getattr(t, "special", False)}
        eos = getattr(tokenizer, "eos_token_ids", None)
        if eos is None:
            eos = {hf.eos_token_id} if getattr(hf, "eos_token_id", None) is not None else set()
        primary = getattr(hf, "eos_token_id", None)

        def encode(text: str) -> list[int]:
            return list(hf.encode(text, add_special_tokens=False))
    eos_ids = sorted(i for i in eos if i is not None and 0 <= i < min(vocab_size, len(raw)))
    if not eos_ids:
        raise GrammarError("the tokenizer has no EOS token id inside the vocabulary")
    if primary in eos_ids:
        eos_ids.remove(primary)
        eos_ids.insert(0, primary)
    n_tok = min(len(raw), vocab_size)
    token_bytes = raw[:n_tok] + [b""] * (vocab_size - n_tok)
    special |= set(eos_ids)

    return Vocab(token_bytes, vocab_size, n_tok, eos_ids, special, encode)


def _bytes_from_hf(hf: Any) -> list[bytes]:
    """Raw bytes per token of a transformers fast tokenizer (byte-level BPE or SentencePiece)."""
    n = len(hf)
    pieces = hf.convert_ids_to_tokens(list(range(n)))
    added = {i: t.content for i, t in (getattr(hf, "added_tokens_decoder", None) or {}).items()}
    table = _unicode_to_bytes()
    byte_level = all(c in table for p in pieces[: min(n, 2000)] if p for c in p)
    out: list[bytes] = []
    for i, p in enumerate(pieces):
        if i in added:
            out.append(added[i].encode("utf-8"))
        elif p is None:
            out.append(b"")
        elif byte_level:
            out.append(bytes(table[c] if c in table else 0x3F for c in p))
        elif len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            out.append(bytes([int(p[3:5], 16)]))
        else:
            out.append(p.replace("\u2581", " ").encode("utf-8"))
    return out
