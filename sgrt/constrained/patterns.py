"""JSON Schema ``pattern`` regexes (ECMA-262): the checks and writers the normalizer and the
backends call, all on :mod:`~sgrt.constrained.ecma_regex`'s one parse of a pattern.

:func:`check_pattern` finds what cannot be compiled into a token automaton (lookaround,
backreferences, anchors or word boundaries where no automaton can place them) or is not
ECMA-262, so the request fails closed with a clear message. :func:`llguidance_pattern` is the
pattern in Rust syntax with ECMA-262's character sets (llguidance). :func:`pattern_to_json_string_regex`
turns a pattern into a regex that matches, in full, the *inside of a JSON string literal* whose
decoded value the pattern matches (outlines-core pastes patterns into its JSON regex as they are:
anchors stripped, an unanchored pattern treated as a full match, ``"`` and ``\\`` not escaped).
That result accepts a subset of the valid strings: characters that JSON must escape are allowed
only where the pattern names them as a single character, and ``\\uXXXX`` escapes are never
produced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from sgrt.constrained import ecma_regex
from sgrt.constrained.ecma_regex import SURROGATES, CharSet, UnsupportedPattern, complement, intersect, norm

# A character that may appear raw inside a JSON string and that needs no escape.
_SAFE_EXCLUDE = r'"\\\x00-\x1F\x7F-\x9F'
SAFE_CHAR = rf"[^{_SAFE_EXCLUDE}]"
_SAFE = intersect(complement(norm([(0x22, 0x22), (0x5C, 0x5C), (0x00, 0x1F), (0x7F, 0x9F)])), complement(SURROGATES))
_JSON_ESCAPES = {0x22: r'\\"', 0x5C: r"\\\\", 0x0A: r"\\n", 0x0D: r"\\r", 0x09: r"\\t", 0x0C: r"\\f",
                 0x08: r"\\b"}


@dataclass
class PatternProblem:
    """Why a pattern cannot be compiled: ``construct`` is the offending syntax."""

    construct: str
    reason: str


def check_pattern(pattern: str) -> PatternProblem | None:
    """The first construct of ``pattern`` that sgrt cannot compile (see the module docstring),
    or None. A lone trailing backslash is one (some engines read it as matching nothing)."""
    try:
        ecma_regex.parse(pattern)
    except UnsupportedPattern as e:
        return PatternProblem(e.construct, e.reason)
    return None


def llguidance_pattern(pattern: str) -> str:
    """``pattern`` as llguidance should read it: :func:`ecma_regex.to_rust` (fully anchored Rust
    syntax, ECMA-262's ``\\d \\w \\s . $ \\b``), with U+0000 left out of character sets that
    llguidance 1.9 mis-compiles inside JSON strings (see :func:`ecma_regex.rust_set`).

    Raises:
        UnsupportedPattern: see :func:`check_pattern`.
    """
    return ecma_regex.to_rust(pattern)


def pattern_to_json_string_regex(pattern: str) -> str:
    """A regex for the JSON-escaped inside of strings matched by ``pattern`` (see module doc).

    Raises:
        UnsupportedPattern: see :func:`check_pattern`.
    """
    return f"(?:{_json(ecma_regex.parse(pattern))})"


def _json_set(cs: CharSet) -> str:
    r = cs.exact()
    if r is None:  # a property class: its raw-safe part only
        items = "".join(cs.props)
        return f"[[{'^' if cs.negated else ''}{items}]&&{SAFE_CHAR}]"
    if len(r) == 1 and r[0][0] == r[0][1]:
        return _literal(r[0][0])
    safe = intersect(r, _SAFE)
    return ecma_regex.rust_set(CharSet(safe))


def _literal(cp: int) -> str:
    """Regex for one character of the decoded string, as it appears JSON-escaped."""
    if cp in _JSON_ESCAPES:
        return _JSON_ESCAPES[cp]
    if cp < 0x20 or 0x7F <= cp <= 0x9F:
        return rf"\\u{cp:04x}"
    if 0xD800 <= cp <= 0xDFFF:
        return "[^\\x{0}-\\x{10FFFF}]"
    return f"\\x{{{cp:X}}}"


def _json(node: tuple) -> str:
    kind = node[0]
    if kind == "set":
        return _json_set(node[1])
    if kind == "cat":
        return "".join(f"(?:{_json(n)})" if n[0] == "alt" else _json(n) for n in node[1]) if node[1] else "(?:)"
    if kind == "alt":
        return "|".join(_json(n) for n in node[1])
    inner, lo, hi = node[1], node[2], node[3]
    body = f"(?:{_json(inner)})"
    return body + (f"{{{lo}}}" if lo == hi else f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}")


def ends_with_lone_backslash(pattern: str) -> bool:
    """Whether ``pattern`` ends in an odd run of backslashes: an escape with nothing to escape
    (llguidance read ``a\\`` as ``a``)."""
    return pattern.endswith("\\") and not _escaped_at(pattern, len(pattern) - 1)


def _escaped_at(s: str, i: int) -> bool:
    k = 0
    while i - 1 - k >= 0 and s[i - 1 - k] == "\\":
        k += 1
    return k % 2 == 1


def chars_outside_classes(p: str) -> Iterator[tuple[int, str]]:
    """``(index, char)`` of each character of regex ``p`` that is neither escaped (``\\x``,
    skipped whole) nor inside a character class (``[...]``, brackets included)."""
    i, in_class = 0, False
    while i < len(p):
        c = p[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        else:
            yield i, c
        i += 1
