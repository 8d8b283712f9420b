"""The per-request Grammar interface the engine drives, and batch mask filling.

A :class:`Grammar` is a token-level automaton for one request: the engine asks it for the
allowed tokens (``fill_vocab_mask``) before each sampling step, tells it the sampled token
(``accept_token``), undoes rejected speculative tokens (``rollback``), and finishes the request
when ``is_terminated()``. Backends implement it in ``llguidance_backend.py`` and
``outlines_backend.py``; :class:`CompiledGrammar` is the cached, shared form a Grammar is copied
from.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch


class Grammar(ABC):
    """A constraint's state for one request.

    Attributes:
        warnings: human-readable notes from compilation (e.g. an unknown ``format`` ignored);
            the engine copies them into the request's result.
        backend: ``"llguidance"`` or ``"outlines"``.
    """

    backend: str = ""

    def __init__(self, warnings: Sequence[str] = ()):
        self.warnings: list[str] = list(warnings)

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. Returns False, leaving the state unchanged, if the token is
        forbidden here. An EOS / end-of-turn id is accepted only in an accepting state."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens exactly (masks afterwards equal those seen before).

        Raises:
            ValueError: ``k`` is negative or more than the tokens accepted so far.
        """

    @abstractmethod
    def is_accepting(self) -> bool:
        """True if the text so far is a complete match: stopping (EOS) is allowed now."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True if no token but EOS can follow (or EOS was accepted): the request finishes
        with finish_reason ``stop``, matched ``grammar``."""

    @classmethod
    def fill_vocab_masks_of(cls, rows: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        """Fill the rows of several grammars of this class (``[(grammar, row), ...]``): row by
        row here; a backend that can fill many at once overrides it."""
        for g, r in rows:
            g.fill_vocab_mask(bitmask, r)

    @abstractmethod
    def fill_vocab_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into ``bitmask[row]``.

        Args:
            bitmask: CPU int32 ``[batch, ceil(vocab_size / 32)]`` from
                :func:`~sgrt.constrained.bitmask.allocate_token_bitmask`; bit set = allowed.
            row: the row of this request.

        EOS and end-of-turn ids are allowed only in an accepting state; ids past the tokenizer
        and special tokens are never allowed.
        """

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Canonical tokens of the text the grammar forces next ([] if none), for jump-forward.

        The run never ends where a longer token could continue it, so appending it verbatim
        ("text" mode) cannot change which tokenization a free choice would have made. The
        tokens are not accepted: the caller feeds them to :meth:`accept_token` (or verifies
        them as a draft).
        """

    @abstractmethod
    def copy(self) -> "Grammar":
        """An independent copy in the same state (for fork / speculative branches)."""

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (what :meth:`rollback` can undo)."""
        return getattr(self, "_n", 0)

    @property
    def error(self) -> str | None:
        """An internal matcher error (e.g. a per-step resource limit), or None."""
        return None


class CompiledGrammar(ABC):
    """A compiled constraint shared through the cache; :meth:`new_grammar` makes per-request
    copies in the start state. Immutable after construction, safe to share across threads."""

    warnings: list[str]

    @abstractmethod
    def new_grammar(self) -> Grammar:
        """A fresh :class:`Grammar` in the start state."""


def fill_vocab_masks(grammars: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
    """Fill the rows of many grammars at once: ``[(grammar, row), ...]``.

    Each grammar class fills its own rows (:meth:`Grammar.fill_vocab_masks_of`): llguidance's
    in parallel on its thread pool (the GIL is released), the rest row by row. Equivalent to
    calling ``g.fill_vocab_mask(bitmask, row)`` for each pair.
    """
    by_kind: dict[type, list[tuple[Grammar, int]]] = {}
    for g, r in grammars:
        by_kind.setdefault(type(g), []).append((g, r))
    for kind, rows in by_kind.items():
        kind.fill_vocab_masks_of(rows, bitmask)
