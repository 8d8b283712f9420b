"""Bounded regexes for the DSL's ``dtype=`` (``int``, ``float``, ``bool``, ``str``) and parsers.

Every regex is bounded, so a small model cannot loop forever inside a value: integers have at
most 19 digits (int64), floats at most 16 + 16 digits and a 3-digit exponent, strings at most
``max_length`` characters. Use the regex as a constraint and :func:`parse_dtype_value` on the
matched text.
"""
from __future__ import annotations

import json
from typing import Any

from sgrt.errors import InvalidRequest

DEFAULT_STR_MAX_LENGTH = 256

INT_REGEX = r"-?(?:0|[1-9][0-9]{0,18})"
FLOAT_REGEX = r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,3})?"
BOOL_REGEX = r"(?:True|False)"


def str_regex(max_length: int = DEFAULT_STR_MAX_LENGTH) -> str:
    """A double-quoted string of at most ``max_length`` characters, JSON escapes allowed."""
    return rf'"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]){{0,{int(max_length)}}}"'


def _name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype
    elif dtype in (int, float, bool, str):
        name = dtype.__name__
    else:
        name = repr(dtype)
    if name not in ("int", "float", "bool", "str"):
        raise InvalidRequest(f"dtype must be int, float, bool or str, got {name}", field="dtype")
    return name


def dtype_regex(dtype: Any, max_length: int = DEFAULT_STR_MAX_LENGTH) -> str:
    """The bounded regex for ``dtype`` (a type or its name: ``int``, ``"float"``, ...).

    Raises:
        InvalidRequest: (field ``dtype``) any other dtype.
    """
    name = _name(dtype)
    if name == "str":
        return str_regex(max_length)
    return {"int": INT_REGEX, "float": FLOAT_REGEX, "bool": BOOL_REGEX}[name]


def parse_dtype_value(dtype: Any, text: str) -> int | float | bool | str:
    """Turn text matched by :func:`dtype_regex` into the Python value.

    Raises:
        InvalidRequest: (field ``dtype``) the text does not parse (e.g. a generation cut short).
    """
    name = _name(dtype)
    try:
        if name == "int":
            return int(text)
        if name == "float":
            return float(text)
        if name == "bool":
            if text not in ("True", "False"):
                raise ValueError(text)
            return text == "True"
        value = json.loads(text)
        if not isinstance(value, str):
            raise ValueError(text)
        return value
    except ValueError as e:
        raise InvalidRequest(f"cannot parse {text!r} as {name}", field="dtype") from e
