"""The default backend: llguidance (regex, JSON Schema, Lark) through ``LLMatcher``.

The token table is llguidance's own (``LLTokenizer``) built from our raw token bytes
(:class:`~sgrt.constrained.vocab.Vocab`), not from the HF tokenizer's JSON, so it sees exactly
the bytes the model's tokens stand for, padded to the logits width. Masks are written by
llguidance straight into the int32 bitmask; many rows at once go through its thread pool
(:func:`fill_masks_parallel`). Forced text comes from ``compute_ff_tokens``, which re-tokenizes
canonically and never ends on a token a longer one could extend.

Reference: llguidance 1.9 Python API (``llguidance/_lib.pyi``) and docs/json_schema.md.
"""
from __future__ import annotations

import re
import threading
from typing import Any

import llguidance
import torch

from sgrt.constrained.bitmask import row_view, set_bits
from sgrt.constrained.grammar import CompiledGrammar, Grammar
from sgrt.constrained.options import GrammarOptions, json_options  # noqa: F401 - json_options re-exported
from sgrt.constrained.schema import PLAIN_ESCAPES_KEY
from sgrt.constrained.unique_keys import KeyTracker, may_repeat_keys, quote_tokens
from sgrt.constrained.vocab import Vocab
from sgrt.errors import GrammarError


class _TokenizerBridge:
    """What ``llguidance.LLTokenizer`` reads from a Python tokenizer (see its ``TokenizerWrapper``)."""

    is_tokenizer_wrapper = True

    def __init__(self, vocab: Vocab):
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = None
        tokens = list(vocab.token_bytes)
        for i in range(vocab.vocab_size):
            if i >= vocab.n_tokenizer or not tokens[i]:
                tokens[i] = b"<|sgrt_unused_%d|>" % i
        self.tokens = tokens
        self.special_token_ids = sorted(
            set(vocab.special_token_ids) | {i for i in range(vocab.vocab_size) if vocab.is_forbidden(i)}
        )
        self._encode = vocab.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class LLGuidanceBackend:
    """Compiles constraints for one vocabulary. Thread-safe (llguidance drops the GIL while it
    builds a grammar); build once per engine, it costs ~0.1-1 s."""

    name = "llguidance"

    def __init__(self, vocab: Vocab, limits: llguidance.LLParserLimits | None = None):
        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(_TokenizerBridge(vocab))
        self.limits = limits
        self.eos_ids = list(vocab.eos_token_ids)
        self.row_bytes = 4 * ((vocab.vocab_size + 31) // 32)
        self._quote_tokens: list[tuple[int, bytes]] | None = None

    def compile_json(self, schema: Any, options: GrammarOptions, warnings: list[str]) -> "LLCompiled":
        """``schema``: a normalized schema (:func:`~sgrt.constrained.schema.normalize_schema`)."""
        overrides = json_options(options)
        if isinstance(schema, dict):
            if schema.get(PLAIN_ESCAPES_KEY):
                # One spelling per key (see schema.PLAIN_ESCAPES_KEY): no \uXXXX escapes.
                overrides.update(json_allowed_escapes='"\\bfnrt', json_allow_general_unicode_escapes=False)
            schema = {k: v for k, v in schema.items() if k not in ("x-guidance", PLAIN_ESCAPES_KEY)}
        else:
            schema = {} if schema is True else {"anyOf": []}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
        compiled = self._build(grammar, "json_schema", warnings, schema)
        # Free keys come from a string lexeme: the grammar cannot stop one repeating (issue 18).
        compiled.unique_keys = may_repeat_keys(schema)
        return compiled

    @property
    def quote_tokens(self) -> list[tuple[int, bytes]]:
        """Tokens whose bytes hold a ``"`` (the only ones that can close a key), built once."""
        if self._quote_tokens is None:
            self._quote_tokens = quote_tokens(self.vocab.token_bytes, lambda i: not self.vocab.is_forbidden(i))
        return self._quote_tokens

    def compile_regex(self, regex: str) -> "LLCompiled":
        """Full-match regex (Rust ``regex`` syntax, no lookaround)."""
        return self._build(llguidance.LLMatcher.grammar_from_regex(regex), "regex", [])

    def compile_lark(self, text: str) -> "LLCompiled":
        """A Lark grammar (llguidance's dialect: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)."""
        return self._build(llguidance.LLMatcher.grammar_from_lark(text), "grammar", [])

    def _build(self, grammar: str, field: str, warnings: list[str], schema: Any = None) -> "LLCompiled":
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            message = matcher.get_error()
            path = _guess_path(schema, message) if schema is not None else None
            raise GrammarError(
                f"{field} could not be compiled (llguidance): {_first_line(message)}", field=field, path=path
            )
        warnings = list(warnings) + [f"llguidance: {w}" for w in matcher.get_grammar_warnings()]
        return LLCompiled(self, matcher, warnings)


class LLCompiled(CompiledGrammar):
    """A compiled llguidance grammar: the matcher in its start state, copied per request."""

    def __init__(self, backend: LLGuidanceBackend, matcher: llguidance.LLMatcher, warnings: list[str]):
        self.backend = backend
        self._template = matcher
        self._lock = threading.Lock()
        self.warnings = warnings
        self.unique_keys = False  # set for JSON schemas whose objects may take free keys

    def new_grammar(self) -> "LLGuidanceGrammar":
        with self._lock:
            matcher = self._template.deep_copy()
        keys = KeyTracker(self.backend.quote_tokens) if self.unique_keys else None
        return LLGuidanceGrammar(self.backend, matcher, self.warnings, keys)


class LLGuidanceGrammar(Grammar):
    """One request's llguidance matcher (see :class:`~sgrt.constrained.grammar.Grammar`)."""

    backend = "llguidance"

    @classmethod
    def fill_vocab_masks_of(cls, rows: Any, bitmask: torch.Tensor) -> None:
        """Several rows at once on llguidance's thread pool (:func:`fill_masks_parallel`)."""
        if len(rows) > 1:
            fill_masks_parallel(rows, bitmask)
        else:
            for g, r in rows:
                g.fill_vocab_mask(bitmask, r)

    def __init__(self, backend: LLGuidanceBackend, matcher: llguidance.LLMatcher, warnings: list[str],
                 keys: KeyTracker | None = None):
        super().__init__(warnings)
        self._b = backend
        self._m = matcher
        self._keys = keys  # no repeated object key (unique_keys.py), where the grammar cannot
        # One entry per accepted token: True if the matcher consumed it. An EOS accepted after the
        # matcher stopped is ours alone (llguidance does not record it), so rollback must skip it.
        self._consumed: list[bool] = []
        self._ended = False

    @property
    def _n(self) -> int:
        return len(self._consumed)

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def accept_token(self, token_id: int) -> bool:
        if self._ended:
            return False
        vocab = self._b.vocab
        if token_id in vocab.eos_token_ids:
            if self._m.is_stopped() and not self._m.is_error():
                self._consumed.append(False)
            elif self._m.is_accepting():
                if self._m.try_consume_tokens([vocab.eos_token_id]) != 1:
                    return False
                self._consumed.append(True)
            elif self._takes_named_eos(token_id):
                self._consumed.append(False)  # checked on a copy; the matcher stays put
            else:
                return False
            if self._keys is not None:
                self._keys.push(b"")
            self._ended = True
            return True
        if not 0 <= token_id < vocab.n_tokenizer:
            return False
        data = vocab.token_bytes[token_id]
        if self._keys is not None and not self._keys.allows(data):
            return False
        # Special ids are never in the mask unless the grammar names them (``<[id]>``, ``<name>``):
        # llguidance, which knows them as special tokens, decides.
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._consumed.append(True)
        if self._keys is not None:
            self._keys.push(data)
        return True

    def _takes_named_eos(self, token_id: int) -> bool:
        """Whether the grammar names this EOS id here (Lark ``<[2]>``) and ends after it.
        llguidance's ``try_consume_tokens`` never takes an EOS id and its ``rollback`` does not
        undo one taken by ``consume_token``, so the matcher is asked on a copy and left as it is:
        generation ends on the EOS, and rolling it back only clears ``_ended``."""
        trial = self._m.deep_copy()
        return bool(trial.consume_token(token_id)) and not trial.is_error() and trial.is_accepting()

    def rollback(self, k: int) -> None:
        if k < 0 or k > len(self._consumed):
            raise ValueError(f"cannot roll back {k} tokens: {len(self._consumed)} accepted")
        if k == 0:
            return
        undone = self._consumed[len(self._consumed) - k :]
        del self._consumed[len(self._consumed) - k :]
        if self._keys is not None:
            self._keys.pop(k)
        n = sum(undone)
        if n and not self._m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self._m.get_error()}")
        self._ended = False

    def is_accepting(self) -> bool:
        return self._ended or self._m.is_accepting()

    def is_terminated(self) -> bool:
        return self._ended or self._m.is_stopped()

    def fill_vocab_mask(self, bitmask: torch.Tensor, row: int) -> None:
        _check_bitmask(bitmask, row, self._b.row_bytes)
        if self._ended:
            bitmask[row].zero_()
            set_bits(row_view(bitmask, row), self._b.eos_ids, True)
            return
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * self._b.row_bytes, self._b.row_bytes)
        self._fix_eos(bitmask, row)

    def _fix_eos(self, bitmask: torch.Tensor, row: int) -> None:
        stop = self._m.is_accepting() or self._m.is_stopped()
        words = row_view(bitmask, row)
        # An EOS id the grammar itself names (Lark ``<[2]>``) keeps the bit llguidance gave it.
        named = [i for i in self._b.eos_ids if not stop and (int(words[i // 32]) >> (i % 32)) & 1]
        set_bits(words, self._b.eos_ids, stop)
        if named:
            set_bits(words, named, True)
        if self._keys is not None:
            repeated = self._keys.forbidden(words)
            if repeated:
                set_bits(words, repeated, False)

    def forced_tokens(self) -> list[int]:
        if self.is_terminated():
            return []
        return list(self._m.compute_ff_tokens())

    def forced_bytes(self) -> bytes:
        """The bytes the grammar forces next (may end inside a token); b"" if none."""
        return b"" if self.is_terminated() else self._m.compute_ff_bytes()

    def copy(self) -> "LLGuidanceGrammar":
        other = LLGuidanceGrammar(self._b, self._m.deep_copy(), self.warnings,
                                  self._keys.copy() if self._keys is not None else None)
        other._consumed = list(self._consumed)
        other._ended = self._ended
        return other


_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def fill_masks_parallel(rows: list[tuple[LLGuidanceGrammar, int]], bitmask: torch.Tensor) -> None:
    """Fill several llguidance rows with llguidance's thread pool (GIL released)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
    live = [(g, r) for g, r in rows if not g._ended]
    if live:
        row_bytes = live[0][0]._b.row_bytes
        _check_bitmask(bitmask, 0, row_bytes)
        _EXECUTOR.unsafe_compute_mask_ptr([(g._m, r) for g, r in live], bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        for g, r in live:
            g._fix_eos(bitmask, r)
    for g, r in rows:
        if g._ended:
            g.fill_vocab_mask(bitmask, r)


def _check_bitmask(bitmask: torch.Tensor, row: int, row_bytes: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous CPU int32 tensor")
    if bitmask.dim() != 2 or bitmask.shape[1] * 4 != row_bytes:
        raise ValueError(f"bitmask must be [batch, {row_bytes // 4}], got {tuple(bitmask.shape)}")
    if not 0 <= row < bitmask.shape[0]:
        raise ValueError(f"row {row} out of range for batch {bitmask.shape[0]}")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _guess_path(schema: Any, message: str) -> str | None:
    """Best-effort JSON pointer of the keyword an llguidance error message talks about."""
    m = re.search(r'Unimplemented keys: \["([^"]+)"', message)
    if m:
        return _find_key(schema, m.group(1))
    m = re.search(r"Unknown format: (\S+)", message)
    if m:
        return _find_key(schema, "format", m.group(1))
    for key in ("oneOf", "patternProperties", "minProperties", "maxProperties", "allOf", "pattern"):
        if key in message:
            return _find_key(schema, key)
    return None


def _find_key(node: Any, key: str, value: Any = None, path: str = "") -> str | None:
    if isinstance(node, dict):
        if key in node and (value is None or node[key] == value):
            return f"{path}/{key}"
        items = node.items()
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return None
    for k, v in items:
        found = _find_key(v, key, value, f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}")
        if found:
            return found
    return None

