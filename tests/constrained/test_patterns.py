"""sgrt/constrained/patterns.py: unsupported-construct detection and pattern rewrites."""
from __future__ import annotations

import pytest

from sgrt.constrained.patterns import UnsupportedPattern, check_pattern, llguidance_pattern, pattern_to_json_string_regex


@pytest.mark.parametrize("pattern, construct", [
    ("^(?=.{3,8}$)[a-z]+$", "(?="), ("^(?!ab)", "(?!"), ("(?<=a)b", "(?<="), ("(?<!a)b", "(?<!"),
    ("(a)\\1", "\\1"), ("(?<n>a)\\k<n>", "\\k<"), ("\\bword\\b", "\\b"),
])
def test_check_pattern_flags(pattern, construct):
    problem = check_pattern(pattern)
    assert problem is not None and problem.construct == construct


@pytest.mark.parametrize("pattern", ["^[a-z]+$", "a(?:b|c)*", "[(?=]", "\\(?=x\\)", "[\\b]", "^\\d{3}-\\w+$"])
def test_check_pattern_passes(pattern):
    assert check_pattern(pattern) is None


def test_llguidance_pattern_nul_classes():
    assert llguidance_pattern("^[^\\\\]+$") == "^[^\\x00\\\\]+$"
    assert llguidance_pattern('^[^"]+$') == '^[^\\x00"]+$'
    assert llguidance_pattern("^[^a]+$") == "^[^a]+$"  # contains both '"' and '\\': fine
    assert llguidance_pattern("^[a-z]+$") == "^[a-z]+$"
    with pytest.raises(UnsupportedPattern):
        llguidance_pattern("^[\\x00-!]+$")


def test_json_string_regex_shapes():
    rx = pattern_to_json_string_regex("^[A-Z]{3}$")
    assert rx.startswith("(?:(?:") and "{3}" in rx and ".*" not in rx
    unanchored = pattern_to_json_string_regex("abc")
    assert unanchored.count('[^"\\\\') >= 2  # free text allowed before and after
    assert '\\\\"' in pattern_to_json_string_regex('^a"b$')  # a literal quote is written escaped
    with pytest.raises(UnsupportedPattern):
        pattern_to_json_string_regex("^a(?=b)")
    with pytest.raises(UnsupportedPattern):
        pattern_to_json_string_regex("(^a)")
