"""The outlines-core backend: regex and JSON Schema through a token-level DFA index.

The ``Vocabulary`` is built from raw token bytes (special and EOS ids excluded: EOS is handled
here, allowed only in accepting states). JSON Schemas go through
:func:`~sgrt.constrained.outlines_schema.prepare` (which refuses what outlines-core would get
wrong) and ``outlines_core.json_schema.build_regex_from_schema``; the regex is patched
(:func:`~sgrt.constrained.outlines_schema.patch_regex`) and compiled into an ``Index``.
A per-request ``Guide`` writes the mask; our own state stack makes ``rollback`` exact.

NOTE: outlines-core 0.2.14's index drops transitions that leave an accepting state through a
non-accepting one (``1(e5)?`` accepts ``1`` but then refuses ``e``), which breaks top-level
numbers and any regex with an optional tail. We therefore compile ``(?:R)`` followed by a
sentinel character (U+10FFFD) that only a virtual token (id ``vocab_size``, outside the mask) can
produce: no state of ``R`` is final any more, and "accepting" means "the sentinel token may
follow". Tokens containing byte 0xF4 (the lead byte of U+100000..U+10FFFF, private use only)
are left out of the vocabulary so that nothing else can start the sentinel.

Forced text is read off the index itself: while the current state is not accepting and every
allowed token starts with the same byte, that byte is forced. (The issue suggested
``interegular`` for this; reading the token index gives the same answer for the automaton that
actually constrains decoding, without a second, Python-dialect regex compiler that could disagree
with Rust's on syntax such as ``\\d`` or class intersections.)

Reference: outlines-core 0.2.14 (``Index``, ``Guide``, ``Vocabulary``; src/json_schema).
"""
from __future__ import annotations

import json
import threading
from typing import Any

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from sgrt.constrained.bitmask import row_view, set_bits
from sgrt.constrained.grammar import CompiledGrammar, Grammar
from sgrt.constrained.options import FLEXIBLE_WHITESPACE_MAX, GrammarOptions
from sgrt.constrained.outlines_schema import bounded_repetitions, patch_regex, prepare
from sgrt.constrained.outlines_worker import IndexWorker
from sgrt.constrained.patterns import chars_outside_classes
from sgrt.constrained.vocab import Vocab
from sgrt.errors import GrammarError

# Above this sum of bounded-repetition sizes the index takes many seconds and hundreds of MB
# (~0.6 s and ~40 MB per 128 bounded string characters inside an object, 49k vocabulary).
MAX_BOUNDED_REPETITIONS = 1024
_MAX_FORCED_BYTES = 128
_SENTINEL = "\U0010FFFD"
_SENTINEL_RX = r"\x{10FFFD}"
_MAX_FORCED_FANOUT = 4096


def whitespace_pattern(options: GrammarOptions) -> str:
    """outlines-core's whitespace regex for our whitespace option."""
    if options.whitespace == "compact":
        return ""
    if options.whitespace == "one_space":
        return "[ ]?"
    return f"[\\x20\\x0A\\x0D\\x09]{{0,{FLEXIBLE_WHITESPACE_MAX}}}"


class OutlinesBackend:
    """Compiles regexes and JSON Schemas into outlines-core indexes for one vocabulary."""

    name = "outlines"

    def __init__(self, vocab: Vocab, compile_timeout_s: float = 10.0):
        self.vocab = vocab
        self.compile_timeout_s = compile_timeout_s
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if not vocab.is_forbidden(i) and 0xF4 not in b:
                table.setdefault(b, []).append(i)
        self.sentinel = vocab.vocab_size  # a virtual id, never in a mask row
        table[_SENTINEL.encode("utf-8")] = [self.sentinel]
        self.worker = IndexWorker(vocab.eos_token_id, table)
        self.eos_ids = list(vocab.eos_token_ids)
        self.row_words = (vocab.vocab_size + 31) // 32
        self.byte_token: dict[int, int] = {}
        for i, b in enumerate(vocab.token_bytes):
            if len(b) == 1 and not vocab.is_forbidden(i):
                self.byte_token.setdefault(b[0], i)

    def schema_regex(self, schema: Any, options: GrammarOptions) -> str:
        """The full-match regex for a normalized schema (raises GrammarError when refused)."""
        prepared = prepare(schema)
        try:
            regex = build_regex_from_schema(json.dumps(prepared), whitespace_pattern(options))
        except Exception as e:  # outlines-core raises ValueError / its own error types
            raise GrammarError(f"json_schema could not be compiled (outlines-core): {e}", field="json_schema") from e
        return patch_regex(regex, options.unicode_escapes)

    def compile_json(self, schema: Any, options: GrammarOptions, warnings: list[str]) -> "OutlinesCompiled":
        regex = self.schema_regex(schema, options)
        return self._build(regex, "json_schema", warnings)

    def compile_regex(self, regex: str) -> "OutlinesCompiled":
        return self._build(regex, "regex", [])

    def compile_lark(self, text: str) -> "OutlinesCompiled":
        raise GrammarError("the outlines backend supports regex and json_schema, not Lark grammars", field="grammar")

    def _build(self, regex: str, field: str, warnings: list[str]) -> "OutlinesCompiled":
        size = bounded_repetitions(regex)
        if size > MAX_BOUNDED_REPETITIONS:
            raise GrammarError(
                f"{field} is too large for the outlines backend: bounded repetitions total {size} "
                f"(limit {MAX_BOUNDED_REPETITIONS}; lower max_string_length / maxLength or use llguidance)",
                field=field,
            )
        body = _strip_anchors(regex, field)
        index = self.worker.build(f"(?:{body}){_SENTINEL_RX}", max(0.1, self.compile_timeout_s - 0.1), field)
        return OutlinesCompiled(self, index, warnings, regex)


def _strip_anchors(regex: str, field: str) -> str:
    """Drop a leading ``^`` / trailing ``$`` (the index always matches in full); refuse others."""
    body = regex[1:] if regex.startswith("^") else regex
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    if any(c in "^$" for _, c in chars_outside_classes(body)):
        raise GrammarError(f"{field}: anchors inside the regex are not supported by the outlines backend", field=field)
    return body


class OutlinesCompiled(CompiledGrammar):
    """A compiled outlines-core index, shared by the requests that use the same constraint."""

    def __init__(self, backend: OutlinesBackend, index: Any, warnings: list[str], regex: str):
        self.backend = backend
        self.index = index
        self.warnings = warnings
        self.regex = regex
        self._terminal: dict[int, bool] = {}
        self._lock = threading.Lock()

    def new_grammar(self) -> "OutlinesGrammar":
        return OutlinesGrammar(self)

    def is_accepting(self, state: int) -> bool:
        """Whether the text that led to ``state`` matches the regex (the sentinel may follow)."""
        nxt = self.index.get_next_state(state, self.backend.sentinel)
        return nxt is not None and self.index.is_final_state(nxt)

    def is_terminal(self, state: int) -> bool:
        """Accepting with no way to continue (cached per state)."""
        hit = self._terminal.get(state)
        if hit is None:
            sentinel = self.backend.sentinel
            hit = self.is_accepting(state) and all(t == sentinel for t in self.index.get_allowed_tokens(state))
            with self._lock:
                self._terminal[state] = hit
        return hit


class OutlinesGrammar(Grammar):
    """One request's position in an outlines-core index (see :class:`Grammar`)."""

    backend = "outlines"

    def __init__(self, compiled: OutlinesCompiled):
        super().__init__(compiled.warnings)
        self._c = compiled
        self._guide = outlines_core.Guide(compiled.index, max_rollback=1 << 20)
        self._states = [compiled.index.get_initial_state()]
        self._tokens: list[int] = []  # accepted tokens, EOS excluded (for copy)
        self._ended_at: int | None = None  # len(_states) when EOS was accepted

    @property
    def _n(self) -> int:
        return len(self._states) - 1 + (1 if self._ended_at is not None else 0)

    @property
    def _state(self) -> int:
        return self._states[-1]

    def accept_token(self, token_id: int) -> bool:
        if self._ended_at is not None:
            return False
        vocab = self._c.backend.vocab
        if token_id in vocab.eos_token_ids:
            if not self._c.is_accepting(self._state):
                return False
            self._ended_at = len(self._states)
            return True
        if vocab.is_forbidden(token_id) or token_id >= vocab.vocab_size:
            return False
        nxt = self._c.index.get_next_state(self._state, token_id)
        if nxt is None:
            return False
        self._guide.advance(token_id, False)
        self._states.append(nxt)
        self._tokens.append(token_id)
        return True

    def rollback(self, k: int) -> None:
        if k < 0 or k > self._n:
            raise ValueError(f"cannot roll back {k} tokens: {self._n} accepted")
        if k and self._ended_at is not None:
            self._ended_at = None
            k -= 1
        if k:
            del self._states[-k:]
            del self._tokens[-k:]
            self._guide.rollback_state(k)

    def is_accepting(self) -> bool:
        return self._ended_at is not None or self._c.is_accepting(self._state)

    def is_terminated(self) -> bool:
        return self._ended_at is not None or self._c.is_terminal(self._state)

    def fill_vocab_mask(self, bitmask: torch.Tensor, row: int) -> None:
        b = self._c.backend
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.shape[1] != b.row_words:
            raise ValueError(f"bitmask must be CPU int32 [batch, {b.row_words}], got {tuple(bitmask.shape)} {bitmask.dtype}")
        view = row_view(bitmask, row)
        if self._ended_at is not None:
            view[:] = 0
            set_bits(view, b.eos_ids, True)
            return
        view[:] = 0
        target = bitmask[row]
        self._guide.write_mask_into(target.data_ptr(), target.numel(), 4)
        set_bits(view, b.eos_ids, self._c.is_accepting(self._state))

    def forced_tokens(self) -> list[int]:
        if self.is_terminated():
            return []
        forced, states = self._forced_bytes()
        if not forced:
            return []
        # Cut at the last complete UTF-8 character, tokenize canonically, check it walks.
        text = forced.decode("utf-8", errors="ignore")
        while text and text.encode("utf-8") != forced[: len(text.encode("utf-8"))]:
            text = text[:-1]
        if not text:
            return []
        vocab = self._c.backend.vocab
        tokens = vocab.encode(text)
        if b"".join(vocab.token_bytes[t] for t in tokens) != text.encode("utf-8"):
            return []
        walk = [self._state]
        for t in tokens:
            nxt = self._c.index.get_next_state(walk[-1], t)
            if nxt is None:
                return []
            walk.append(nxt)
        return self._chop(tokens, walk, len(text.encode("utf-8")))

    def forced_bytes(self) -> bytes:
        """The bytes the grammar forces next (may end inside a character); b"" if none."""
        return b"" if self.is_terminated() else self._forced_bytes()[0]

    def _forced_bytes(self) -> tuple[bytes, list[int]]:
        index, b = self._c.index, self._c.backend
        tb = b.vocab.token_bytes
        skip = set(b.eos_ids) | {b.sentinel}
        state, out, states = self._state, bytearray(), [self._state]
        while len(out) < _MAX_FORCED_BYTES and not self._c.is_accepting(state):
            allowed = index.get_allowed_tokens(state)
            if len(allowed) > _MAX_FORCED_FANOUT:
                break
            first = {tb[t][0] for t in allowed if t not in skip and tb[t]}
            if len(first) != 1:
                break
            byte = first.pop()
            tok = b.byte_token.get(byte)
            nxt = index.get_next_state(state, tok) if tok is not None else None
            if nxt is None:
                break
            out.append(byte)
            state = nxt
            states.append(state)
        return bytes(out), states

    def _chop(self, tokens: list[int], walk: list[int], n_bytes: int) -> list[int]:
        """Drop trailing tokens that a longer token, crossing the end of the forced text, could
        replace (so appending the run verbatim never changes the tokenization)."""
        tb = self._c.backend.vocab.token_bytes
        index = self._c.index
        cut = len(tokens)
        for i in range(max(0, len(tokens) - 4), len(tokens)):
            rest = b"".join(tb[t] for t in tokens[i:])
            allowed = index.get_allowed_tokens(walk[i])
            if len(allowed) > _MAX_FORCED_FANOUT or any(
                t < len(tb) and len(tb[t]) > len(rest) and tb[t].startswith(rest) for t in allowed
            ):
                cut = i
                break
        return tokens[:cut]

    def copy(self) -> "OutlinesGrammar":
        other = OutlinesGrammar(self._c)
        for t in self._tokens:  # replay, so the guide's own state and history match
            other.accept_token(t)
        other._ended_at = self._ended_at
        return other
