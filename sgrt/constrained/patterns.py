"""JSON Schema ``pattern`` regexes (ECMA-262 syntax): checks, and a rewrite for outlines-core.

:func:`check_pattern` finds what no backend can compile into a token automaton (lookaround,
backreferences, word boundaries) so the request fails closed with a clear message.

:func:`pattern_to_json_string_regex` turns a pattern (search semantics: it may match anywhere in
the string unless anchored) into a regex that matches, in full, the *inside of a JSON string
literal* whose decoded value the pattern matches. outlines-core pastes patterns into its JSON
regex as they are (anchors stripped, an unanchored pattern treated as a full match, ``"`` and
``\\`` not escaped); this rewrite is what makes its answer right. The result accepts a subset
of the valid strings: characters that JSON must escape are allowed only where the pattern names
them literally, and ``\\uXXXX`` escapes are never produced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

# A character that may appear raw inside a JSON string and that needs no escape.
_SAFE_EXCLUDE = r'"\\\x00-\x1F\x7F-\x9F'
SAFE_CHAR = rf"[^{_SAFE_EXCLUDE}]"
# ECMA "." excludes line terminators; a raw one is not allowed in JSON anyway.
_DOT = rf"[^{_SAFE_EXCLUDE}\u2028\u2029]"
_JSON_ESCAPES = {'"': r'\\"', "\\": r"\\\\", "\n": r"\\n", "\r": r"\\r", "\t": r"\\t", "\f": r"\\f", "\b": r"\\b"}
_CLASS_SHORTHANDS = {"d": "0-9", "w": "0-9A-Za-z_", "s": r" \t\n\r\x0B\x0C\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFEFF"}
_META = set(".^$|?*+()[]{}\\/")


@dataclass
class PatternProblem:
    """Why a pattern cannot be compiled: ``construct`` is the offending syntax."""

    construct: str
    reason: str


class UnsupportedPattern(ValueError):
    """A pattern uses syntax we cannot turn into a finite automaton (see ``problem``)."""

    def __init__(self, problem: PatternProblem):
        super().__init__(f"{problem.construct!r}: {problem.reason}")
        self.problem = problem


def check_pattern(pattern: str) -> PatternProblem | None:
    """The first construct of ``pattern`` that no automaton backend supports, or None.

    Catches lookahead / lookbehind (``(?=``, ``(?!``, ``(?<=``, ``(?<!``), backreferences
    (``\\1``, ``\\k<name>``), word boundaries (``\\b``, ``\\B`` outside a class) and a lone
    trailing backslash (which some engines read as matching nothing).
    """
    if ends_with_lone_backslash(pattern):
        return PatternProblem("\\", "a lone backslash at the end escapes nothing")
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if not in_class:
                if e in "123456789":
                    return PatternProblem("\\" + e, "backreferences are not regular")
                if e == "k" and i + 2 < n and pattern[i + 2] == "<":
                    return PatternProblem("\\k<", "backreferences are not regular")
                if e in "bB":
                    return PatternProblem("\\" + e, "word-boundary assertions are not supported")
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
        elif c == "(" and pattern.startswith("(?", i):
            for look in ("(?=", "(?!", "(?<=", "(?<!"):
                if pattern.startswith(look, i):
                    kind = "lookahead" if look[2] in "=!" else "lookbehind"
                    return PatternProblem(look, f"{kind} assertions are not supported")
        i += 1
    return None


def pattern_to_json_string_regex(pattern: str) -> str:
    """A regex for the JSON-escaped inside of strings matched by ``pattern`` (see module doc).

    Raises:
        UnsupportedPattern: lookaround, backreferences, anchors inside groups, ``\\p`` classes
            inside ``[...]``, or other syntax this rewrite does not handle.
    """
    problem = check_pattern(pattern)
    if problem is not None:
        raise UnsupportedPattern(problem)
    branches = _split_top_level(pattern)
    out = []
    for branch in branches:
        start = branch.startswith("^")
        end = branch.endswith("$") and not _escaped_at(branch, len(branch) - 1)
        body = branch[1 if start else 0 : len(branch) - 1 if end else len(branch)]
        rx = _rewrite(body)
        out.append(("" if start else f"{SAFE_CHAR}*") + f"(?:{rx})" + ("" if end else f"{SAFE_CHAR}*"))
    return "(?:" + "|".join(out) + ")"


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


def _split_top_level(p: str) -> list[str]:
    """Split ``p`` at ``|`` outside groups and classes."""
    parts, depth, last = [], 0, 0
    for i, c in chars_outside_classes(p):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(p[last:i])
            last = i + 1
    parts.append(p[last:])
    return parts


def _literal(ch: str) -> str:
    """Regex for one literal character of the decoded string, as it appears JSON-escaped."""
    if ch in _JSON_ESCAPES:
        return _JSON_ESCAPES[ch]
    o = ord(ch)
    if o < 0x20 or 0x7F <= o <= 0x9F:
        return rf"\\u{o:04x}"
    if ch in _META or ch in "-&~#" or ch.isspace():
        return f"\\x{o:02x}" if o < 0x100 else f"\\u{{{o:04x}}}"
    return ch


def _escape_value(p: str, i: int) -> tuple[str | None, str, int]:
    """Parse the escape at ``p[i] == '\\'``: (literal char or None, shorthand/class text, next i)."""
    if i + 1 >= len(p):
        raise UnsupportedPattern(PatternProblem("\\", "dangling backslash"))
    e = p[i + 1]
    simple = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}
    if e in simple:
        return simple[e], "", i + 2
    if e == "x" and i + 3 < len(p):
        return chr(int(p[i + 2 : i + 4], 16)), "", i + 4
    if e == "u":
        if p.startswith("{", i + 2):
            j = p.index("}", i + 2)
            return chr(int(p[i + 3 : j], 16)), "", j + 1
        return chr(int(p[i + 2 : i + 6], 16)), "", i + 6
    if e == "c":
        raise UnsupportedPattern(PatternProblem("\\c", "control escapes are not supported"))
    if e in "dwsDWS":
        return None, e, i + 2
    if e in "pP":
        j = p.index("}", i + 2) if p.startswith("{", i + 2) else i + 2
        return None, p[i : j + 1], j + 1
    return e, "", i + 2  # an escaped metacharacter or an identity escape


def _rewrite(body: str) -> str:
    out: list[str] = []
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == "\\":
            lit, short, i = _escape_value(body, i)
            if lit is not None:
                out.append(_literal(lit))
            elif short in ("d", "w", "s"):
                out.append(f"[[{_CLASS_SHORTHANDS[short]}]&&{SAFE_CHAR}]")
            elif short in ("D", "W", "S"):
                out.append(f"[^{_CLASS_SHORTHANDS[short.lower()]}{_SAFE_EXCLUDE}]")
            else:  # \p{..} / \P{..}
                out.append(f"[{short}&&{SAFE_CHAR}]")
            continue
        if c == "[":
            cls, i = _rewrite_class(body, i)
            out.append(cls)
            continue
        if c == ".":
            out.append(_DOT)
        elif c in "^$":
            raise UnsupportedPattern(PatternProblem(c, "anchors inside groups are not supported"))
        elif c == "(":
            if body.startswith("(?:", i):
                out.append("(?:")
                i += 3
                continue
            if body.startswith("(?<", i) or body.startswith("(?P<", i):
                j = body.index(">", i)
                out.append("(?:")
                i = j + 1
                continue
            if body.startswith("(?", i):
                raise UnsupportedPattern(PatternProblem(body[i : i + 3], "group flags are not supported"))
            out.append("(?:")
        elif c in ")|*+?":
            out.append(c)
        elif c == "{":
            j = body.find("}", i)
            q = body[i + 1 : j] if j > 0 else ""
            if j > 0 and q and all(ch.isdigit() or ch == "," for ch in q) and q[0] != ",":
                out.append(body[i : j + 1])
                i = j + 1
                continue
            out.append(_literal(c))
        else:
            out.append(_literal(c))
        i += 1
    return "".join(out)


def _rewrite_class(p: str, i: int) -> tuple[str, int]:
    """Rewrite the class starting at ``p[i] == '['``; returns (regex, index after ``]``)."""
    j = i + 1
    negated = p.startswith("^", j)
    if negated:
        j += 1
    items: list[str] = []
    while j < len(p) and p[j] != "]":
        c = p[j]
        if c == "\\":
            lit, short, j = _escape_value(p, j)
            if lit is not None:
                items.append(_class_literal(lit))
            elif short in ("d", "w", "s"):
                items.append(_CLASS_SHORTHANDS[short])
            elif short.startswith(("\\p", "\\P")):
                items.append(short)
            else:
                raise UnsupportedPattern(PatternProblem("\\" + short, "negated shorthand inside [...]"))
            continue
        if c == "-" and items and j + 1 < len(p) and p[j + 1] != "]":
            items.append("-")
            j += 1
            continue
        if c == "[" and p.startswith("[:", j):
            raise UnsupportedPattern(PatternProblem("[:", "POSIX classes are not ECMA-262 syntax"))
        items.append(_class_literal(c))
        j += 1
    if j >= len(p):
        raise UnsupportedPattern(PatternProblem("[", "unterminated character class"))
    inner = "".join(items)
    if not inner:
        return ("[^\\x00-\\x{10FFFF}]" if not negated else _DOT), j + 1
    if negated:
        return f"[^{inner}{_SAFE_EXCLUDE}]", j + 1
    return f"[[{inner}]&&{SAFE_CHAR}]", j + 1


def _class_literal(ch: str) -> str:
    o = ord(ch)
    if ch.isalnum() and o < 0x80:
        return ch
    return f"\\x{{{o:x}}}"


def llguidance_pattern(pattern: str) -> str:
    """Work around an llguidance 1.9 soundness bug in ``pattern`` (JSON strings).

    When a character class contains U+0000 but not both ``"`` and ``\\``, llguidance lets the
    escapes ``\\"`` and ``\\\\`` through anyway: ``^[^\\\\]+$`` accepts ``"a\\\\b"``. Negated
    classes get U+0000 added to their exclusions (a NUL in a generated string is no loss);
    a positive class with U+0000 is refused.

    Raises:
        UnsupportedPattern: a positive class containing U+0000 but not ``"`` and ``\\``.
    """
    import re

    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if c != "[":
            out.append(c)
            i += 1
            continue
        j = i + 1
        while j < n and pattern[j] != "]":
            j += 2 if pattern[j] == "\\" else 1
        cls = pattern[i : j + 1]
        i = j + 1
        try:
            rx = re.compile(cls) if cls not in ("[]", "[^]") else None
        except re.error:
            rx = None
        if rx is None or not rx.match("\0") or (rx.match('"') and rx.match("\\")):
            out.append(cls)
        elif cls.startswith("[^"):
            out.append("[^\\x00" + cls[2:])
        else:
            raise UnsupportedPattern(
                PatternProblem(cls, 'a class with U+0000 but without both \'"\' and \'\\\' (llguidance mis-compiles it)')
            )
    return "".join(out)
