"""ECMA-262 regular expressions (JSON Schema ``pattern``), parsed once and written for each engine.

JSON Schema 2020-12 (validation 6.3.3, core 4.3.1 / 6.4) says a ``pattern`` is an ECMA-262
regular expression that is not implicitly anchored, and the JSON Schema Test Suite reads it with
Unicode semantics (``optional/ecmascript-regex.json``). The engines under sgrt read other
dialects: llguidance takes Rust ``regex`` syntax, where ``\\s`` is Unicode White_Space (U+0085
yes, U+FEFF no), ``.`` only excludes ``\\n``, and ``\\b`` is not supported; Python's ``re`` has a
``$`` that also matches before a final newline and Unicode ``\\d`` / ``\\w``. So every pattern
goes through :func:`parse` into a small tree whose character sets are ECMA-262's own, and the
writers emit that tree for an engine:

- :func:`to_rust` -- fully anchored Rust syntax (llguidance's ``pattern`` / ``patternProperties``
  and sgrt's own static checks, :func:`search`, which run the same text through llguidance, so
  a static check and the grammar never disagree);
- :func:`to_json_string_regex` -- the JSON-escaped inside of a string literal (outlines-core).

ECMA-262 definitions used (22.2.2.9, CharacterClassEscape; 12.2 / 12.3): ``\\d`` = [0-9];
``\\w`` = [A-Za-z0-9_] (no ``i`` flag); ``\\s`` = WhiteSpace (TAB, VT, FF, SP, NBSP, ZWNBSP U+FEFF,
category Zs) plus LineTerminator (LF, CR, LS U+2028, PS U+2029); ``.`` = any code point but a
LineTerminator (no ``s`` flag); ``$`` / ``^`` = end / start of input (no ``m`` flag); ``\\b`` = a
position where exactly one of the characters on each side is in ``\\w`` (the ends of the input
count as non-word).

Accepted syntax: Unicode-mode ECMA-262 (``\\u{...}``, surrogate pairs joined, ``\\p{...}`` /
``\\P{...}`` passed to the engine's Unicode tables), plus Annex B's leniencies that real schemas
rely on: an escaped punctuation character is itself (``\\-``, ``\\_``, ``\\@``), ``{`` / ``}`` /
``]`` that start no quantifier or class are literal, and ``-`` next to a class escape in a class
(``[\\w-.]``) is literal. Refused with :class:`~sgrt.constrained.patterns.UnsupportedPattern`:
lookaround, backreferences, group modifiers and other non-ECMA group syntax (``(?P<..>``,
``(?i)``), unknown letter escapes (``\\a``: an error in Unicode mode, a literal in Annex B),
anchors or ``\\b`` where a token automaton cannot place them (see :func:`parse`).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Iterable, Union

MAX_CP = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]


class UnsupportedPattern(ValueError):
    """A pattern uses syntax we cannot turn into a finite automaton, or that is not ECMA-262
    (``construct``: the offending text; ``reason``: why)."""

    def __init__(self, construct: str, reason: str):
        super().__init__(f"{construct!r}: {reason}")
        self.construct = construct
        self.reason = reason


# ---- code point sets -------------------------------------------------------------------------

def norm(ranges: "Iterable[tuple[int, int]]") -> Ranges:
    """Sorted, merged ``(lo, hi)`` code point ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(ranges: Ranges) -> Ranges:
    """The code points (0 to U+10FFFF) not in ``ranges`` (sorted, merged)."""
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return tuple(out)


def intersect(a: Ranges, b: Ranges) -> Ranges:
    """The code points in both ``a`` and ``b`` (each sorted, merged)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def contains(ranges: Ranges, cp: int) -> bool:
    """Whether code point ``cp`` is in ``ranges``."""
    return any(lo <= cp <= hi for lo, hi in ranges)


#: ECMA-262 ``\d``: DecimalDigit.
DIGIT: Ranges = ((0x30, 0x39),)
#: ECMA-262 ``\w`` without the ``i`` flag: WordCharacters = [A-Za-z0-9_].
WORD: Ranges = norm([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
#: ECMA-262 LineTerminator: LF, CR, LINE SEPARATOR, PARAGRAPH SEPARATOR.
LINE_TERMINATORS: Ranges = norm([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)])
#: Unicode general category Zs (Space_Separator), Unicode 15 / 16.
SPACE_SEPARATORS: Ranges = norm([(0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                                 (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)])
#: ECMA-262 WhiteSpace: TAB, VT, FF, ZWNBSP and Zs (SP and NBSP are Zs).
WHITE_SPACE: Ranges = norm([(0x09, 0x09), (0x0B, 0x0C), (0xFEFF, 0xFEFF), *SPACE_SEPARATORS])
#: ECMA-262 ``\s``: WhiteSpace plus LineTerminator.
SPACE: Ranges = norm([*WHITE_SPACE, *LINE_TERMINATORS])
#: ECMA-262 ``.`` without the ``s`` flag: every code point but a LineTerminator.
DOT: Ranges = complement(LINE_TERMINATORS)
ANY: Ranges = ((0, MAX_CP),)
SURROGATES: Ranges = ((0xD800, 0xDFFF),)


@dataclass(frozen=True)
class CharSet:
    """A set of code points: ``ranges`` united with Unicode property escapes ``props``
    (``\\p{..}`` / ``\\P{..}``, whose members only the engine's tables know), complemented when
    ``negated``."""

    ranges: Ranges = ()
    props: tuple[str, ...] = ()
    negated: bool = False

    def exact(self) -> Ranges | None:
        """The code points, or None when a property escape makes them the engine's to know."""
        if self.props:
            return None
        return complement(self.ranges) if self.negated else self.ranges


Node = Union[tuple]  # ("set", CharSet) | ("cat", nodes) | ("alt", nodes) | ("rep", node, lo, hi)
#                     | ("bol",) | ("eol",) | ("wb", negated)
EMPTY: Node = ("cat", ())


def _set(ranges: Ranges) -> Node:
    return ("set", CharSet(ranges))


# ---- parser ----------------------------------------------------------------------------------

_SYNTAX = set("^$\\.*+?()[]{}|/")
_MAX_GROUP_DEPTH = 100


class _Parser:
    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.depth = 0

    def fail(self, construct: str, reason: str) -> UnsupportedPattern:
        return UnsupportedPattern(construct, reason)

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def disjunction(self) -> Node:
        alts = [self.alternative()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.alternative())
        return alts[0] if len(alts) == 1 else ("alt", tuple(alts))

    def alternative(self) -> Node:
        items: list[Node] = []
        while self.i < len(self.s) and self.peek() not in "|)":
            items.append(self.term())
        return items[0] if len(items) == 1 else ("cat", tuple(items))

    def term(self) -> Node:
        c = self.peek()
        start = self.i
        if c == "^":
            self.i += 1
            atom: Node = ("bol",)
        elif c == "$":
            self.i += 1
            atom = ("eol",)
        elif c == "\\" and self.peek(1) in ("b", "B"):
            self.i += 2
            atom = ("wb", self.peek(-1) == "B")
        elif c == "(":
            atom = self.group()
        elif c == "[":
            atom = ("set", self.char_class())
        elif c == ".":
            self.i += 1
            atom = _set(DOT)
        elif c == "\\":
            atom = self.atom_escape()
        elif c in "*+?":
            raise self.fail(c, "a quantifier with nothing to repeat")
        elif c == "{" and self.quantifier_at(self.i) is not None:
            raise self.fail(self.s[self.i:self.i + 8], "a quantifier with nothing to repeat")
        else:  # a pattern character; Annex B: a lone ] { } is itself
            self.i += 1
            cp, self.i = self.code_point_at(start)
            atom = _set(((cp, cp),))
        q = self.quantifier_at(self.i)
        if q is None:
            return atom
        lo, hi, end = q
        if atom[0] in ("bol", "eol", "wb"):
            raise self.fail(self.s[start:end], "a quantified assertion")
        if hi is not None and lo > hi:
            raise self.fail(self.s[start:end], "a quantifier whose minimum exceeds its maximum")
        self.i = end
        if self.peek() == "?":  # lazy: the set of matches is the same
            self.i += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.quantifier_at(self.i) is not None):
            raise self.fail(self.s[start:self.i + 1], "a quantifier with nothing to repeat")
        return ("rep", atom, lo, hi)

    def code_point_at(self, j: int) -> tuple[int, int]:
        """The code point at ``j`` (a lone surrogate of a str is one, as it is to ECMA-262)."""
        return ord(self.s[j]), j + 1

    def quantifier_at(self, j: int) -> tuple[int, int | None, int] | None:
        c = self.s[j] if j < len(self.s) else ""
        if c == "*":
            return 0, None, j + 1
        if c == "+":
            return 1, None, j + 1
        if c == "?":
            return 0, 1, j + 1
        if c != "{":
            return None
        k = self.s.find("}", j)
        if k < 0:
            return None
        body = self.s[j + 1:k]
        lo_text, comma, hi_text = body.partition(",")
        if not lo_text.isdigit() or not lo_text.isascii() or (hi_text and not (hi_text.isdigit() and hi_text.isascii())):
            return None
        lo = int(lo_text)
        hi = lo if not comma else (int(hi_text) if hi_text else None)
        return lo, hi, k + 1

    def group(self) -> Node:
        start = self.i
        self.i += 1
        s = self.s
        if s.startswith("?", self.i):
            for look in ("?=", "?!", "?<=", "?<!"):
                if s.startswith(look, self.i):
                    kind = "lookahead" if look[1] in "=!" else "lookbehind"
                    raise self.fail("(" + look, f"{kind} assertions are not supported")
            if s.startswith("?:", self.i):
                self.i += 2
            elif s.startswith("?<", self.i):
                end = s.find(">", self.i)
                name = s[self.i + 2:end] if end > 0 else ""
                if not name or not (name[0].isalpha() or name[0] in "_$") or \
                        not all(ch.isalnum() or ch in "_$" for ch in name):
                    raise self.fail(s[start:self.i + 3], "not an ECMA-262 group name")
                self.i = end + 1
            else:
                raise self.fail(s[start:self.i + 3], "group modifiers and other (? forms are not ECMA-262 "
                                "groups that sgrt supports (use (?:...) or (?<name>...))")
        self.depth += 1
        if self.depth > _MAX_GROUP_DEPTH:
            raise self.fail("(", f"groups nested deeper than {_MAX_GROUP_DEPTH}")
        inner = self.disjunction()
        self.depth -= 1
        if self.peek() != ")":
            raise self.fail(s[start:start + 10], "an unclosed group")
        self.i += 1
        return inner if inner[0] != "cat" or inner[1] else EMPTY

    def atom_escape(self) -> Node:
        e = self.peek(1)
        if e == "":
            raise self.fail("\\", "a lone backslash at the end escapes nothing")
        if e in "123456789":
            raise self.fail("\\" + e, "backreferences are not regular")
        if e == "k":
            raise self.fail("\\k", "backreferences are not regular")
        cs = self.class_escape_set(e)
        if cs is not None:
            return ("set", cs)
        cp = self.character_escape()
        return _set(((cp, cp),))

    def class_escape_set(self, e: str) -> CharSet | None:
        """``\\d \\D \\s \\S \\w \\W \\p{..} \\P{..}`` at ``self.i`` (consumed), else None."""
        table = {"d": DIGIT, "s": SPACE, "w": WORD}
        if e.lower() in table:
            self.i += 2
            r = table[e.lower()]
            return CharSet(r if e.islower() else complement(r))
        if e in "pP":
            if self.peek(2) != "{":
                raise self.fail("\\" + e, "a property escape needs {Name}")
            end = self.s.find("}", self.i)
            name = self.s[self.i + 3:end] if end > 0 else ""
            if not name or not all(ch.isalnum() or ch in "_=" for ch in name):
                raise self.fail(self.s[self.i:self.i + 12], "not a Unicode property escape")
            self.i = end + 1
            return CharSet((), (f"\\{e}{{{name}}}",))
        return None

    def character_escape(self) -> int:
        """A CharacterEscape at ``self.i`` (the backslash), consumed; its code point."""
        s, i = self.s, self.i
        e = s[i + 1]
        simple = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
        if e in simple:
            self.i += 2
            return simple[e]
        if e == "c":
            letter = s[i + 2] if i + 2 < len(s) else ""
            if not (letter.isascii() and letter.isalpha()):
                raise self.fail("\\c" + letter, "\\c must be followed by an ASCII letter")
            self.i += 3
            return ord(letter) % 32
        if e == "0":
            if i + 2 < len(s) and s[i + 2].isdigit():
                raise self.fail(s[i:i + 3], "octal escapes are not ECMA-262 in Unicode mode")
            self.i += 2
            return 0
        if e == "x":
            h = s[i + 2:i + 4]
            if len(h) != 2 or not _is_hex(h):
                raise self.fail(s[i:i + 4], "\\x must be followed by two hex digits")
            self.i += 4
            return int(h, 16)
        if e == "u":
            return self.unicode_escape()
        if e.isascii() and e.isalnum():
            raise self.fail("\\" + e, "not an ECMA-262 escape (Unicode mode refuses it; Annex B reads it as "
                            f"{e!r}): write {e!r} or the escape you meant")
        # an identity escape: a syntax character, or (Annex B) any other non-letter
        self.i += 2
        cp = ord(e)
        if 0xD800 <= cp <= 0xDBFF and i + 2 < len(s) and 0xDC00 <= ord(s[i + 2]) <= 0xDFFF:
            self.i += 1
            cp = 0x10000 + ((cp - 0xD800) << 10) + (ord(s[i + 2]) - 0xDC00)
        return cp

    def unicode_escape(self) -> int:
        s, i = self.s, self.i
        if s.startswith("{", i + 2):
            end = s.find("}", i + 2)
            h = s[i + 3:end] if end > 0 else ""
            if not h or not _is_hex(h) or int(h, 16) > MAX_CP:
                raise self.fail(s[i:i + 12], "\\u{...} must hold a code point in hex")
            self.i = end + 1
            return int(h, 16)
        h = s[i + 2:i + 6]
        if len(h) != 4 or not _is_hex(h):
            raise self.fail(s[i:i + 6], "\\u must be followed by four hex digits")
        cp = int(h, 16)
        self.i += 6
        if 0xD800 <= cp <= 0xDBFF and s.startswith("\\u", self.i):
            low = s[self.i + 2:self.i + 6]
            if len(low) == 4 and _is_hex(low) and 0xDC00 <= int(low, 16) <= 0xDFFF:
                self.i += 6
                cp = 0x10000 + ((cp - 0xD800) << 10) + (int(low, 16) - 0xDC00)
        return cp

    def char_class(self) -> CharSet:
        s = self.s
        start = self.i
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        props: list[str] = []
        while True:
            if self.i >= len(s):
                raise self.fail(s[start:start + 10], "an unterminated character class")
            if self.peek() == "]":
                self.i += 1
                break
            first = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                save = self.i
                self.i += 1
                second = self.class_atom()
                if isinstance(first, int) and isinstance(second, int):
                    if first > second:
                        raise self.fail(s[start:self.i], "a class range out of order")
                    ranges.append((first, second))
                    continue
                # Annex B: a range with a class escape on either side is the atoms and a '-';
                # the atom after the '-' is read again by the loop
                self.i = save + 1
                self._add(first, ranges, props)
                ranges.append((0x2D, 0x2D))
                continue
            self._add(first, ranges, props)
        return CharSet(norm(ranges), tuple(props), negated)

    @staticmethod
    def _add(atom: int | CharSet, ranges: list, props: list) -> None:
        if isinstance(atom, int):
            ranges.append((atom, atom))
        elif atom.props:
            if atom.negated or atom.ranges:
                raise AssertionError("a property escape is parsed alone")
            props.extend(atom.props)
        else:
            ranges.extend(atom.exact() or ())

    def class_atom(self) -> int | CharSet:
        c = self.peek()
        if c != "\\":
            cp, self.i = self.code_point_at(self.i)
            return cp
        e = self.peek(1)
        if e == "":
            raise self.fail("\\", "a lone backslash at the end escapes nothing")
        if e == "b":  # backspace inside a class
            self.i += 2
            return 8
        if e == "-":
            self.i += 2
            return 0x2D
        if e in "123456789":
            raise self.fail("\\" + e, "not an ECMA-262 class escape (an octal or a backreference)")
        cs = self.class_escape_set(e)
        return cs if cs is not None else self.character_escape()


def _is_hex(text: str) -> bool:
    return all(ch in "0123456789abcdefABCDEF" for ch in text)


@functools.lru_cache(maxsize=1024)
def parse(pattern: str) -> Node:
    """The tree of an ECMA-262 ``pattern`` with its search semantics made explicit: a branch not
    anchored at its start gets a leading ``[^]*`` (any code points), one not anchored at its end
    a trailing one, and every ``^`` / ``$`` is then gone (the tree matches whole strings).

    ``^`` is supported where it can only match at the start (first in the pattern or in a
    group that is, through alternatives), ``$`` likewise at the end; elsewhere the pattern is
    refused. ``\\b`` / ``\\B`` are resolved into character sets (:func:`_resolve_boundaries`)
    where they stand directly in a top-level branch.

    Raises:
        UnsupportedPattern: what the module docstring lists, or invalid ECMA-262 syntax.
    """
    p = _Parser(pattern)
    tree = p.disjunction()
    if p.i < len(pattern):  # a ')' with no group open
        raise UnsupportedPattern(pattern[p.i:p.i + 10], "an unmatched ')'")
    tree, at_start = _strip_start(tree)
    if not at_start:
        tree = _cat(_ANY_STAR, tree)
    tree, at_end = _strip_end(tree)
    if not at_end:
        tree = _cat(tree, _ANY_STAR)
    if _has(tree, ("bol", "eol")):
        raise UnsupportedPattern("^" if _has(tree, ("bol",)) else "$",
                                 "an anchor inside the pattern (a token automaton supports ^ and $ only at the "
                                 "start and end of the pattern or of its top-level alternatives)")
    if _has(tree, ("wb",)):
        tree = _resolve_boundaries(tree)
    return tree


_ANY_STAR: Node = ("rep", _set(ANY), 0, None)


def _cat(*parts: Node) -> Node:
    items: list[Node] = []
    for part in parts:
        items.extend(part[1] if part[0] == "cat" else (part,))
    return items[0] if len(items) == 1 else ("cat", tuple(items))


def _strip_start(node: Node) -> tuple[Node, bool]:
    """``node`` (at the start of the pattern) without its leading ``^``s, and whether every match
    is anchored there; unanchored alternatives of an anchored group get ``[^]*``."""
    kind = node[0]
    if kind == "bol":
        return EMPTY, True
    if kind == "cat" and node[1]:
        head, anchored = _strip_start(node[1][0])
        return _cat(head, *node[1][1:]) if len(node[1]) > 1 else head, anchored
    if kind == "alt":
        parts = [_strip_start(b) for b in node[1]]
        if not any(a for _, a in parts):
            return node, False
        return ("alt", tuple(b if a else _cat(_ANY_STAR, b) for b, a in parts)), True
    return node, False


def _strip_end(node: Node) -> tuple[Node, bool]:
    """:func:`_strip_start`'s mirror for ``$``. Parts after a ``$`` that can match the empty
    string can only match it there (``a$(b)?`` is ``a$``), so they are dropped."""
    kind = node[0]
    if kind == "eol":
        return EMPTY, True
    if kind == "cat" and node[1]:
        items = node[1]
        for k in range(len(items) - 1, -1, -1):
            tail, anchored = _strip_end(items[k])
            if anchored:
                return _cat(*items[:k], tail) if k else tail, True
            if not _nullable(items[k]) or _has(items[k], ("bol", "eol", "wb")):
                break
        return node, False
    if kind == "alt":
        parts = [_strip_end(b) for b in node[1]]
        if not any(a for _, a in parts):
            return node, False
        return ("alt", tuple(b if a else _cat(b, _ANY_STAR) for b, a in parts)), True
    return node, False


def _has(node: Node, kinds: tuple[str, ...]) -> bool:
    kind = node[0]
    if kind in kinds:
        return True
    if kind in ("cat", "alt"):
        return any(_has(n, kinds) for n in node[1])
    if kind == "rep":
        return _has(node[1], kinds)
    return False


# ---- word boundaries -------------------------------------------------------------------------

# A boundary's context: the wordness of the character before it ("w", "n") or the start ("s");
# a requirement on the next character: "w" (a word character), "n" (a non-word one or the end).
_MAX_BOUNDARY_NODES = 4000
_MAX_BOUNDARIES = 6


def _resolve_boundaries(tree: Node) -> Node:
    """``tree`` (anchored, see :func:`parse`) with each ``\\b`` / ``\\B`` turned into choices of
    character sets, exactly. Supported where a boundary stands directly in a top-level branch
    (not inside a group or a quantifier); the parts before and after it may be anything without
    a boundary.

    Raises:
        UnsupportedPattern: a boundary elsewhere, or one whose expansion would be too large.
    """
    if tree[0] == "cat":  # [^]* (a|b) [^]*: the alternatives become the top-level branches
        spots = [i for i, item in enumerate(tree[1]) if item[0] == "alt" and _has(item, ("wb",))]
        if len(spots) == 1:
            i, items = spots[0], tree[1]
            tree = ("alt", tuple(_cat(*items[:i], b, *items[i + 1:]) for b in items[i][1]))
    branches = tree[1] if tree[0] == "alt" else (tree,)
    out = []
    for branch in branches:
        items = branch[1] if branch[0] == "cat" else (branch,)
        if any(_has(item, ("wb",)) for item in items if item[0] != "wb"):
            raise UnsupportedPattern("\\b", "a word boundary inside a group or under a quantifier")
        if sum(item[0] == "wb" for item in items) > _MAX_BOUNDARIES:  # each may split in three
            raise UnsupportedPattern("\\b", f"more than {_MAX_BOUNDARIES} word boundaries in one branch")
        out.append(_resolve_items(list(items), "s", None))
    result = out[0] if len(out) == 1 else ("alt", tuple(out))
    if _size(result) > _MAX_BOUNDARY_NODES:
        raise UnsupportedPattern("\\b", "word boundaries whose exact expansion is too large")
    return result


def _resolve_items(items: list[Node], before: str, need: str | None) -> Node:
    """The concatenation of ``items`` matched after a character of context ``before`` with the
    first character meeting ``need`` (None: no requirement; "n" also allows the end)."""
    if "wb" not in [item[0] for item in items]:
        return _require_first(_cat(*items) if items else EMPTY, need)
    k = next(i for i, item in enumerate(items) if item[0] == "wb")
    left = _cat(*items[:k]) if k else EMPTY
    rest, negated = items[k + 1:], items[k][1]
    options: list[Node] = []
    # Split the part before the boundary by its last character (or its being empty).
    for last in ("w", "n", ""):
        if last == "":  # the part before matched nothing: the context and requirement go on
            if not _nullable(left):
                continue
            piece, ctx, carried = EMPTY, before, need
        else:
            piece, ctx, carried = _require_first(_last_is(left, last), need), last, None
        if _is_empty(piece):
            continue
        word_before = ctx == "w"
        # \b: the next character's wordness differs; \B: it is the same (start counts non-word)
        after = ("n" if word_before else "w") if not negated else ("w" if word_before else "n")
        if carried is not None and carried != after:
            continue  # two boundaries at one position that cannot both hold
        tail = _resolve_items(rest, ctx, after)
        if not _is_empty(tail):
            options.append(_cat(piece, tail))
    if not options:
        return _set(())
    return options[0] if len(options) == 1 else ("alt", tuple(options))


def _nullable(node: Node) -> bool:
    kind = node[0]
    if kind == "set":
        return False
    if kind == "cat":
        return all(_nullable(n) for n in node[1])
    if kind == "alt":
        return any(_nullable(n) for n in node[1])
    if kind == "rep":
        return node[2] == 0 or _nullable(node[1])
    return True


def _is_empty(node: Node) -> bool:
    """Whether ``node`` matches nothing at all (not even the empty string)."""
    kind = node[0]
    if kind == "set":
        r = node[1].exact()
        return r is not None and not r
    if kind == "cat":
        return any(_is_empty(n) for n in node[1])
    if kind == "alt":
        return all(_is_empty(n) for n in node[1])
    if kind == "rep":
        return node[2] > 0 and _is_empty(node[1])
    return False


def _restrict(cs: CharSet, wordness: str) -> CharSet:
    r = cs.exact()
    if r is None:
        raise UnsupportedPattern("\\b", "a word boundary next to a \\p{...} property class")
    return CharSet(intersect(r, WORD if wordness == "w" else complement(WORD)))


def _require_first(node: Node, need: str | None) -> Node:
    """``node``'s strings whose first character meets ``need`` ("w"; "n": non-word, or the
    string is empty and the requirement passes on: the caller's tail is the end or checks it)."""
    if need is None:
        return node
    return _first_is(node, need, allow_empty=(need == "n"))


def _first_is(node: Node, wordness: str, allow_empty: bool) -> Node:
    kind = node[0]
    if kind == "set":
        return ("set", _restrict(node[1], wordness))
    if kind == "alt":
        return ("alt", tuple(_first_is(n, wordness, allow_empty) for n in node[1]))
    if kind == "cat":
        items = node[1]
        if not items:
            return EMPTY if allow_empty else _set(())
        head = items[0]
        rest = _cat(*items[1:]) if len(items) > 1 else EMPTY
        options = [_cat(_first_is(head, wordness, False), rest)]
        if _nullable(head):
            options.append(_first_is(rest, wordness, allow_empty))
        return options[0] if len(options) == 1 else ("alt", tuple(options))
    if kind == "rep":
        inner, lo, hi = node[1], node[2], node[3]
        if hi == 0:
            return EMPTY if allow_empty else _set(())
        # the first non-empty repetition decides; empty ones may be dropped (inner nullable)
        more = ("rep", inner, max(lo - 1, 0), None if hi is None else hi - 1)
        options = [_cat(_first_is(inner, wordness, False), more)]
        if allow_empty and (lo == 0 or _nullable(inner)):
            options.append(EMPTY)
        return options[0] if len(options) == 1 else ("alt", tuple(options))
    raise AssertionError(kind)


def _last_is(node: Node, wordness: str) -> Node:
    """``node``'s non-empty strings whose last character has ``wordness``."""
    kind = node[0]
    if kind == "set":
        return ("set", _restrict(node[1], wordness))
    if kind == "alt":
        return ("alt", tuple(_last_is(n, wordness) for n in node[1]))
    if kind == "cat":
        items = node[1]
        if not items:
            return _set(())
        last = items[-1]
        init = _cat(*items[:-1]) if len(items) > 1 else EMPTY
        options = [_cat(init, _last_is(last, wordness))]
        if _nullable(last) and len(items) > 1:
            options.append(_last_is(init, wordness))
        return options[0] if len(options) == 1 else ("alt", tuple(options))
    if kind == "rep":
        inner, lo, hi = node[1], node[2], node[3]
        if hi == 0:
            return _set(())
        more = ("rep", inner, max(lo - 1, 0), None if hi is None else hi - 1)
        return _cat(more, _last_is(inner, wordness))
    raise AssertionError(kind)


def _size(node: Node, budget: int = _MAX_BOUNDARY_NODES + 1) -> int:
    """Nodes in ``node`` written out (shared subtrees counted each time), counted up to
    ``budget`` at most."""
    total, stack = 0, [node]
    while stack and total < budget:
        n = stack.pop()
        total += 1
        if n[0] in ("cat", "alt"):
            stack.extend(n[1])
        elif n[0] == "rep":
            stack.append(n[1])
    return total


# ---- writers ---------------------------------------------------------------------------------

_PLAIN_PUNCTUATION = "-_:;,'\"!%<>=@/ "


def _hex(cp: int) -> str:
    return f"\\x{{{cp:X}}}"


def _rust_ranges(ranges: Ranges) -> str:
    return "".join(_hex(lo) if lo == hi else f"{_hex(lo)}-{_hex(hi)}" for lo, hi in ranges)


def rust_set(cs: CharSet, nul_guard: bool = False) -> str:
    """A Rust ``regex`` class for ``cs`` (surrogates, which no JSON string holds once decoded
    and Rust classes cannot name, left out). ``nul_guard``: leave U+0000 out of a set that has
    it without both ``"`` and ``\\``, which llguidance 1.9 mis-compiles inside a JSON string (it
    then lets ``\\"`` / ``\\\\`` through, so ``[^"]`` accepted a quote); a NUL is no loss."""
    r = cs.exact()
    if r is None:
        items = _rust_ranges(cs.ranges) + "".join(cs.props)
        text = f"[{'^' if cs.negated else ''}{items}]"
        return f"[{text}&&[\\x{{1}}-\\x{{10FFFF}}]]" if nul_guard else text
    if nul_guard and contains(r, 0) and not (contains(r, 0x22) and contains(r, 0x5C)):
        r = intersect(r, ((1, MAX_CP),))
    r = intersect(r, complement(SURROGATES))
    if not r:
        return "[^\\x{0}-\\x{10FFFF}]"
    if len(r) == 1 and r[0][0] == r[0][1]:
        ch = chr(r[0][0])  # written as itself where Rust reads it so outside a class
        return ch if ch.isascii() and (ch.isalnum() or ch in _PLAIN_PUNCTUATION) else _hex(r[0][0])
    return f"[{_rust_ranges(r)}]"


def _rust(node: Node, nul_guard: bool) -> str:
    kind = node[0]
    if kind == "set":
        return rust_set(node[1], nul_guard)
    if kind == "cat":
        return "".join(_rust_group(n, nul_guard) if n[0] == "alt" else _rust(n, nul_guard) for n in node[1]) \
            if node[1] else "(?:)"
    if kind == "alt":
        return "|".join(_rust(n, nul_guard) for n in node[1])
    if kind == "rep":
        inner, lo, hi = node[1], node[2], node[3]
        body = _rust(inner, nul_guard) if inner[0] == "set" else _rust_group(inner, nul_guard)
        if (lo, hi) == (0, None):
            return body + "*"
        if (lo, hi) == (1, None):
            return body + "+"
        if (lo, hi) == (0, 1):
            return body + "?"
        return body + (f"{{{lo}}}" if lo == hi else f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}")
    raise AssertionError(kind)


def _rust_group(node: Node, nul_guard: bool) -> str:
    return f"(?:{_rust(node, nul_guard)})"


@functools.lru_cache(maxsize=1024)
def to_rust(pattern: str, nul_guard: bool = True) -> str:
    """``pattern`` (ECMA-262) as a fully anchored Rust ``regex`` (``^(?:...)$``) that matches
    exactly the strings in which ``pattern`` finds a match, with ECMA-262's character sets.
    ``nul_guard``: see :func:`rust_set` (on for JSON strings, the default).

    Raises:
        UnsupportedPattern: see :func:`parse`.
    """
    return f"^(?:{_rust(parse(pattern), nul_guard)})$"


# ---- static checks ---------------------------------------------------------------------------

class _ByteTokenizer:
    """One token a byte, for llguidance: a string is fed as its UTF-8 bytes."""

    is_tokenizer_wrapper = True

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<|end|>"]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@functools.lru_cache(maxsize=1)
def _byte_tokenizer():
    import llguidance

    return llguidance.LLTokenizer(_ByteTokenizer())


_COPY_LOCK = threading.Lock()


@functools.lru_cache(maxsize=256)
def _matcher(rust_regex: str):
    import llguidance

    m = llguidance.LLMatcher(_byte_tokenizer(), llguidance.LLMatcher.grammar_from_regex(rust_regex), log_level=0)
    if m.is_error():
        raise UnsupportedPattern(rust_regex[:20], f"the regex engine refused it: {m.get_error().splitlines()[0]}")
    return m


def rust_full_match(rust_regex: str, text: str) -> bool:
    """Whether llguidance's regex engine matches all of ``text`` with ``rust_regex`` (Rust
    syntax, e.g. :func:`to_rust`'s output).

    Raises:
        UnsupportedPattern: the engine refused the regex.
    """
    template = _matcher(rust_regex)
    with _COPY_LOCK:  # compiles run on several threads; copies of one matcher are taken one at a time
        m = template.deep_copy()
    data = text.encode("utf-8", errors="surrogatepass")
    return m.try_consume_tokens(list(data)) == len(data) and m.is_accepting()


def search(pattern: str, text: str) -> bool:
    """Whether ECMA-262 ``pattern`` finds a match in ``text`` (JSON Schema's ``pattern``
    keyword), decided by llguidance on :func:`to_rust`'s translation: the same regex engine and
    the same text the grammar uses, so a static check agrees with generation.

    Raises:
        UnsupportedPattern: see :func:`parse`.
    """
    return rust_full_match(to_rust(pattern, False), text)


@functools.lru_cache(maxsize=1)
def _ecma_validator_class():
    import jsonschema
    from jsonschema.exceptions import ValidationError

    def pattern(validator, patrn, instance, schema):  # noqa: ANN001 (jsonschema's keyword signature)
        if validator.is_type(instance, "string") and isinstance(patrn, str):
            try:
                found = search(patrn, instance)
            except UnsupportedPattern as e:
                yield ValidationError(f"pattern {patrn!r} is not supported: {e}")
                return
            if not found:
                yield ValidationError(f"{instance!r} does not match {patrn!r}")

    base = jsonschema.Draft202012Validator
    return jsonschema.validators.extend(base, {"pattern": pattern})


def ecma_validator(schema: object):
    """A ``jsonschema`` Draft 2020-12 validator for ``schema`` (plain JSON) whose ``pattern``
    matches with :func:`search` (ECMA-262 semantics through the same translation and engine as
    the grammar) instead of Python's ``re``: what sgrt uses when it decides a schema of strings
    statically (``propertyNames`` against listed keys). A pattern sgrt cannot compile fails
    validation (the key is then not allowed: sound)."""
    return _ecma_validator_class()(schema)
