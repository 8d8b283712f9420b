"""Exception types raised by every layer of sgrt.

Messages name the offending field and the limit it broke, so that a user can fix the request
without reading our code. A misspelled Python keyword argument stays a plain ``TypeError``.
"""
from __future__ import annotations

import re


class SgrtError(Exception):
    """Base class of every error sgrt raises on purpose."""


class InvalidRequest(SgrtError, ValueError):
    """A request field has a bad value (``field`` names it)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class GrammarError(InvalidRequest):
    """A constraint (regex, JSON Schema, grammar) could not be compiled or is unsupported.

    ``path`` is the JSON pointer of the offending schema keyword when known.
    """

    def __init__(self, message: str, field: str | None = None, path: str | None = None):
        super().__init__(message, field)
        self.path = path


class ContextLengthExceeded(InvalidRequest):
    """The prompt plus ``max_tokens`` does not fit in the model's context window."""


class CapacityError(SgrtError):
    """A request can never fit in the KV pool, however much is evicted."""


class ModelLoadError(SgrtError):
    """A model spec could not be resolved or loaded (names the spec and where we looked)."""


class RequestAborted(SgrtError):
    """A request was aborted (cancelled, disconnected, or failed); ``__cause__`` holds why."""


# Lines of a multi-line message that only point into it: carets, or a source echo ("  1 | ...").
_POINTER_LINE = re.compile(r"^\s*([\^~\-\s]+|\d+\s*\|.*)$")


def one_line(exc: BaseException | str) -> str:
    """An error message on one line: its lines joined (``"; "``, or a space after a colon),
    pointer lines (carets, echoed source) left out; the exception's type when it has none."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__ if isinstance(exc, BaseException) else ""
    out = ""
    for line in text.splitlines():
        line = " ".join(line.split())
        if not line or _POINTER_LINE.match(line):
            continue
        out = line if not out else out + (" " if out.endswith(":") else "; ") + line
    return out
