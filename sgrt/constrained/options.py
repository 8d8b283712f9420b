"""Generation options for JSON Schema constraints (whitespace, closed objects, string caps)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgrt.errors import GrammarError

# Grammar backends (llguidance the default); here, not in compiler, so a config checks the name
# without importing the compiler and its schema modules (~0.1 s of a warm load).
BACKENDS = ("llguidance", "outlines")
WHITESPACE_MODES = ("compact", "one_space", "flexible")
ADDITIONAL_PROPERTIES_DEFAULTS = ("closed", "open")

# Documented defaults (README / DESIGN): a small model given an unbounded string or unbounded
# whitespace can loop forever, so both are bounded unless the schema or the caller says otherwise.
DEFAULT_MAX_STRING_LENGTH = 256
# Numbers: at most this many digits before the decimal point (|x| < 10**15) and after it. A
# free number is otherwise one token stream of digits with no end; llguidance's multipleOf
# (how the fraction bound is enforced) takes at most 10 fraction digits.
DEFAULT_MAX_INTEGER_DIGITS = 15
DEFAULT_MAX_FRACTION_DIGITS = 10
# "flexible" whitespace: one run of at most this many JSON whitespace characters (a newline and
# up to 19 spaces of indentation, enough for pretty-printed JSON nested 9 levels deep at 2).
FLEXIBLE_WHITESPACE_MAX = 20
_JSON_WS = r"[\x20\x0A\x0D\x09]"


@dataclass(frozen=True)
class GrammarOptions:
    """How a JSON Schema is turned into a grammar. Part of the compile-cache key.

    Attributes:
        whitespace: ``"compact"`` (default: no whitespace outside strings, ``{"a":1,"b":[2]}``),
            ``"one_space"`` (at most one space after ``,`` and ``:``), or ``"flexible"``
            (JSON whitespace between tokens, each run at most :data:`FLEXIBLE_WHITESPACE_MAX`
            characters).
        additional_properties_default: ``"closed"`` (default): an object schema that lists
            ``properties`` and says nothing about ``additionalProperties`` allows no other keys
            (what structured-output users expect); ``"open"`` follows the specification. Object
            schemas that take part in ``allOf`` / sibling-``$ref`` composition stay open, because
            closing one branch would forbid the other branch's keys.
        max_string_length: cap (in characters) put on every ``"type": "string"`` schema that sets
            no ``maxLength``, ``enum`` or ``const``, formatted ones (``email``, ``uri``, ...)
            included;
            ``None`` leaves free strings unbounded. Default :data:`DEFAULT_MAX_STRING_LENGTH`.
            llguidance only: outlines-core's index grows with every bounded character (~0.6 s and
            ~40 MB per 128 characters of one string field, minutes for a top-level string), so
            that backend leaves free strings unbounded and honours only the schema's own
            ``maxLength``.
            Values allowed by an empty schema (``{}`` / ``true``) are not capped.
        max_integer_digits: numbers of a ``"type": "number"`` / ``"integer"`` schema that sets no
            bound on a side get one at ``10**max_integer_digits - 1`` on that side (``minimum``
            / ``maximum``), so a number has at most this many digits before the point.
            Default :data:`DEFAULT_MAX_INTEGER_DIGITS`; ``None``: unbounded. llguidance only.
        max_fraction_digits: ``"type": "number"`` schemas without ``multipleOf`` get
            ``multipleOf: 10**-max_fraction_digits``: at most this many digits after the point
            (1 to 10). Default :data:`DEFAULT_MAX_FRACTION_DIGITS`; ``None``: unbounded.
            llguidance only. With any numeric bound, llguidance writes numbers without an
            exponent and zero without a sign (``1000``, not ``1e3``; ``0``, not ``-0``).
        unicode_escapes: allow ``\\uXXXX`` escapes for any character in strings (default True),
            not only for control characters.
    """

    whitespace: str = "compact"
    additional_properties_default: str = "closed"
    max_string_length: int | None = DEFAULT_MAX_STRING_LENGTH
    unicode_escapes: bool = True
    max_integer_digits: int | None = DEFAULT_MAX_INTEGER_DIGITS
    max_fraction_digits: int | None = DEFAULT_MAX_FRACTION_DIGITS

    def __post_init__(self) -> None:
        if self.whitespace not in WHITESPACE_MODES:
            raise GrammarError(
                f"whitespace must be one of {WHITESPACE_MODES}, got {self.whitespace!r}", field="whitespace"
            )
        if self.additional_properties_default not in ADDITIONAL_PROPERTIES_DEFAULTS:
            raise GrammarError(
                "additional_properties_default must be one of "
                f"{ADDITIONAL_PROPERTIES_DEFAULTS}, got {self.additional_properties_default!r}",
                field="additional_properties_default",
            )
        if self.max_string_length is not None and (
            isinstance(self.max_string_length, bool)
            or not isinstance(self.max_string_length, int)
            or self.max_string_length < 1
        ):
            raise GrammarError(
                f"max_string_length must be None or an int >= 1, got {self.max_string_length!r}",
                field="max_string_length",
            )
        for name, hi in (("max_integer_digits", 300), ("max_fraction_digits", 10)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
                raise GrammarError(f"{name} must be None or an int in [1, {hi}], got {v!r}", field=name)


def json_options(options: GrammarOptions) -> dict[str, Any]:
    """llguidance JSON compile options (the ``x-guidance`` keys) for our :class:`GrammarOptions`."""
    opts: dict[str, Any] = {
        "whitespace_flexible": False,
        "item_separator": ",",
        "key_separator": ":",
        "coerce_one_of": False,
        "lenient": False,
        "json_allow_general_unicode_escapes": options.unicode_escapes,
    }
    if options.whitespace == "one_space":
        opts["item_separator"] = ", ?"
        opts["key_separator"] = ": ?"
    elif options.whitespace == "flexible":
        opts["whitespace_pattern"] = f"{_JSON_WS}{{1,{FLEXIBLE_WHITESPACE_MAX}}}"
    return opts
