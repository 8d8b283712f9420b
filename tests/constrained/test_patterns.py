"""sgrt/constrained/patterns.py: unsupported-construct detection and pattern writers (on
sgrt/constrained/ecma_regex.py's parse; its semantics are tested in test_exact_semantics.py)."""
from __future__ import annotations

import pytest

from sgrt.constrained.patterns import UnsupportedPattern, check_pattern, llguidance_pattern, pattern_to_json_string_regex


@pytest.mark.parametrize("pattern, construct", [
    ("^(?=.{3,8}$)[a-z]+$", "(?="), ("^(?!ab)", "(?!"), ("(?<=a)b", "(?<="), ("(?<!a)b", "(?<!"),
    ("(a)\\1", "\\1"), ("(?<n>a)\\k<n>", "\\k"), ("(\\bword)+", "\\b"), ("a\\", "\\"),
])
def test_check_pattern_flags(pattern, construct):
    problem = check_pattern(pattern)
    assert problem is not None and problem.construct == construct


@pytest.mark.parametrize("pattern", ["^[a-z]+$", "a(?:b|c)*", "[(?=]", "\\(?=x\\)", "[\\b]", "^\\d{3}-\\w+$",
                                     "\\bword\\b"])
def test_check_pattern_passes(pattern):
    assert check_pattern(pattern) is None


def test_llguidance_pattern_nul_classes():
    # U+0000 leaves sets that have it without both '"' and '\' (llguidance 1.9 mis-compiles them)
    assert llguidance_pattern("^[^\\\\]+$") == "^(?:[\\x{1}-\\x{5B}\\x{5D}-\\x{D7FF}\\x{E000}-\\x{10FFFF}]+)$"
    assert llguidance_pattern('^[^"]+$') == "^(?:[\\x{1}-\\x{21}\\x{23}-\\x{D7FF}\\x{E000}-\\x{10FFFF}]+)$"
    assert llguidance_pattern("^[a-z]+$") == "^(?:[\\x{61}-\\x{7A}]+)$"
    assert llguidance_pattern("^[\\x00-!]+$") == "^(?:[\\x{1}-\\x{21}]+)$"  # a positive set: narrowed too


def test_json_string_regex_shapes():
    rx = pattern_to_json_string_regex("^[A-Z]{3}$")
    assert rx.startswith("(?:") and "{3}" in rx and ".*" not in rx
    unanchored = pattern_to_json_string_regex("abc")
    assert unanchored.count("\\x{20}-\\x{21}") == 2  # free text allowed before and after
    assert '\\\\"' in pattern_to_json_string_regex('^a"b$')  # a literal quote is written escaped
    with pytest.raises(UnsupportedPattern):
        pattern_to_json_string_regex("^a(?=b)")
    with pytest.raises(UnsupportedPattern):
        pattern_to_json_string_regex("(a^)")
