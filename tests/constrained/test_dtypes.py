"""sgrt/constrained/dtypes.py: bounded regexes for the DSL's dtype= and their parsers."""
from __future__ import annotations

import re

import pytest

from sgrt.constrained import dtype_regex, parse_dtype_value
from sgrt.errors import InvalidRequest


@pytest.mark.parametrize("dtype, good, bad", [
    (int, ["0", "-12", "123456789012345678"], ["01", "+1", "1.0", "12345678901234567890"]),
    ("float", ["0", "-1.5", "2e10", "3.25E-3"], ["1.", ".5", "+1", "1e1234"]),
    (bool, ["True", "False"], ["true", "1"]),
    (str, ['"hi"', '"a \\"q\\""', '""'], ["hi", '"a"b"', '"' + "x" * 300 + '"']),
])
def test_regexes(dtype, good, bad):
    rx = re.compile(dtype_regex(dtype))
    for text in good:
        assert rx.fullmatch(text), text
    for text in bad:
        assert not rx.fullmatch(text), text


def test_parse_and_errors():
    assert parse_dtype_value("int", "-3") == -3
    assert parse_dtype_value(float, "2e1") == 20.0
    assert parse_dtype_value(bool, "False") is False
    assert parse_dtype_value(str, '"a\\nb"') == "a\nb"
    with pytest.raises(InvalidRequest):
        parse_dtype_value(int, "1.5")
    with pytest.raises(InvalidRequest) as err:
        dtype_regex(list)
    assert err.value.field == "dtype"
