"""JSON Schema's own number and regex semantics (issue 42), through the mask and the matcher.

Numbers: bounds, ``const``, ``enum`` and ``multipleOf`` compare mathematical values (JSON Schema
2020-12, validation 6.2 / 6.1.3); the judge is ``jsonschema`` on schema and instance parsed with
exact numbers (``int`` / ``Decimal``). Regexes: ``pattern``, ``patternProperties`` and
``propertyNames`` follow ECMA-262; the judge is a table of ECMA-262's definitions written here
(``\\s`` = WhiteSpace + LineTerminator, ``\\d``, ``\\w``, ``.``, ``$``, ``\\b``), with the Zs
category taken from Python's ``unicodedata`` (an independent source of the Unicode data).

Every instance is fed token by token: before each token the mask is filled and must agree with
``accept_token`` (the engine trusts the mask), and at the end the grammar must accept.
"""
from __future__ import annotations

import json
import unicodedata
from decimal import Decimal

import jsonschema
import pytest

from sgrt.constrained import allocate_token_bitmask
from sgrt.constrained.ecma_regex import search, to_rust
from sgrt.constrained.patterns import check_pattern
from sgrt.engine.sampling_params import SamplingParams
from sgrt.errors import GrammarError

# ---- ECMA-262's definitions, written out (not imported from the code under test) ---------------
ZS = {cp for cp in range(0x3001) if unicodedata.category(chr(cp)) == "Zs"}
ECMA_WHITESPACE = {0x09, 0x0B, 0x0C, 0x20, 0xA0, 0xFEFF} | ZS  # ECMA-262 12.2, Table 35
ECMA_LINE_TERMINATORS = {0x0A, 0x0D, 0x2028, 0x2029}  # 12.3, Table 36
ECMA_S = ECMA_WHITESPACE | ECMA_LINE_TERMINATORS  # 22.2.2.9: \s
ECMA_D = set(range(0x30, 0x3A))  # DecimalDigit
ECMA_W = ECMA_D | set(range(0x41, 0x5B)) | set(range(0x61, 0x7B)) | {0x5F}  # WordCharacters, no i flag

# Code points the table is checked on: all of Latin-1 and General Punctuation, every space
# separator, and spread samples elsewhere (astral ones too); never surrogates.
SAMPLE = sorted(
    set(range(0x00, 0x250)) | set(range(0x2000, 0x2070)) | ZS | ECMA_S | {0x85, 0x180E, 0x200B, 0x2060}
    | {0x0660, 0x0663, 0x06F3, 0x07C0, 0x09EA, 0xFF10, 0xFF21, 0x1D7CE}  # non-ASCII digits and letters
    | set(range(0x250, 0xD800, 211)) | set(range(0xE000, 0x10FFFF, 4099)) | {0x1F600, 0x10FFFF}
)

ESCAPES = {
    "\\s": lambda cp: cp in ECMA_S,
    "\\S": lambda cp: cp not in ECMA_S,
    "\\d": lambda cp: cp in ECMA_D,
    "\\D": lambda cp: cp not in ECMA_D,
    "\\w": lambda cp: cp in ECMA_W,
    "\\W": lambda cp: cp not in ECMA_W,
    ".": lambda cp: cp not in ECMA_LINE_TERMINATORS,
    "[\\s]": lambda cp: cp in ECMA_S,
    "[^\\d]": lambda cp: cp not in ECMA_D,
    "[\\w-]": lambda cp: cp in ECMA_W or cp == 0x2D,
    "[^]": lambda cp: True,
}


def test_the_table_itself():
    # a few rows any reader of ECMA-262 can check by eye
    assert {0x85} - ECMA_S == {0x85} and 0xFEFF in ECMA_S and 0x180E not in ECMA_S and 0x3000 in ECMA_S
    assert ZS == {0x20, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000}


@pytest.mark.parametrize("escape", list(ESCAPES))
def test_class_escapes_match_ecma_262_on_every_sampled_code_point(escape):
    want = ESCAPES[escape]
    wrong = [hex(cp) for cp in SAMPLE if search(f"^{escape}$", chr(cp)) != want(cp)]
    assert not wrong, f"{escape}: {wrong[:20]}"


# ---- the grammar: mask and matcher -------------------------------------------------------------

def walk(compiler, grammar, text: str) -> bool:
    """Feed ``text``'s tokens; the mask must agree with accept_token at every step."""
    vocab = compiler.vocab
    bm = allocate_token_bitmask(1, vocab.vocab_size)
    for t in vocab.encode(text):
        grammar.fill_vocab_mask(bm, 0)
        allowed = bool((int(bm[0, t // 32]) >> (t % 32)) & 1)
        took = grammar.accept_token(t)
        assert allowed == took, f"mask {allowed} but accept_token {took} at token {t} of {text!r}"
        if not took:
            return False
    return grammar.is_accepting()


def accepts(compiler, schema, text: str) -> bool:
    return walk(compiler, compiler.compile(SamplingParams(json_schema=schema)), text)


def refused(compiler, schema) -> GrammarError:
    with pytest.raises(GrammarError) as e:
        compiler.compile(SamplingParams(json_schema=schema))
    return e.value


def exact_valid(schema, text: str) -> bool:
    """JSON Schema's verdict with exact numbers (schema given as JSON text or a dict)."""
    schema_text = schema if isinstance(schema, str) else json.dumps(schema)
    exact = json.loads(schema_text, parse_float=Decimal)
    return jsonschema.Draft202012Validator(exact).is_valid(json.loads(text, parse_float=Decimal))


# Characters that show each escape's difference from Rust / Python semantics, raw in the JSON
# string (as a generator writes them).
GRAMMAR_ROWS = [
    ("^\\s$", ["\u0085", "\ufeff", "\u2003", "\u2029", " ", "\u180e"]),
    ("^\\S$", ["\ufeff", "\u0085", "\u00a0", "x"]),
    ("^\\d$", ["\u0663", "\u09ea", "7"]),
    ("^\\D$", ["\u0663", "7"]),
    ("^\\w$", ["\u00e9", "_", "\u0663"]),
    ("^\\W$", ["\u00e9", "a"]),
    ("^.$", ["\u2028", "\u2029", "\u0085", "\U0001F600"]),
    ("^a$", ["a\n", "a"]),  # $ is the end of input, not before a final newline
    ("^a.$", ["a\r", "ab"]),
    ("\\bcat\\b", ["a cat.", "concat", "cats", "cat"]),
    ("^x\\B", ["xy", "x", "x-"]),
]


def _pattern_cases():
    for pattern, values in GRAMMAR_ROWS:
        for v in values:
            yield pattern, v


def _ecma_search_by_table(pattern: str, value: str) -> bool:
    """The ECMA-262 answer for the rows above, from the table (no regex engine involved)."""
    if pattern == "\\bcat\\b":
        i = value.find("cat")
        while i >= 0:
            before = value[i - 1] if i else ""
            after = value[i + 3] if i + 3 < len(value) else ""
            if (not before or ord(before) not in ECMA_W) and (not after or ord(after) not in ECMA_W):
                return True
            i = value.find("cat", i + 1)
        return False
    if pattern == "^x\\B":
        return value.startswith("x") and len(value) > 1 and ord(value[1]) in ECMA_W
    if pattern == "^a$":
        return value == "a"
    if pattern == "^a.$":
        return len(value) == 2 and value[0] == "a" and ord(value[1]) not in ECMA_LINE_TERMINATORS
    escape = pattern[1:-1]
    return len(value) == 1 and ESCAPES[escape](ord(value))


@pytest.mark.parametrize("pattern, value", list(_pattern_cases()))
def test_pattern_patternproperties_propertynames_follow_ecma(compiler, pattern, value):
    want = _ecma_search_by_table(pattern, value)
    assert search(pattern, value) is want
    text = json.dumps(value, ensure_ascii=False)
    # pattern
    assert accepts(compiler, {"type": "string", "pattern": pattern}, text) is want
    # patternProperties (the key must match, the object is otherwise closed)
    obj = json.dumps({value: 1}, ensure_ascii=False, separators=(",", ":"))
    schema = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}, "additionalProperties": False}
    assert accepts(compiler, schema, obj) is want
    # propertyNames on a map (rewritten into a pattern key)
    schema = {"type": "object", "propertyNames": {"pattern": pattern}, "additionalProperties": {"type": "integer"}}
    assert accepts(compiler, schema, obj) is want
    # propertyNames checked statically against listed properties
    schema = {"type": "object", "properties": {value: {"type": "integer"}, "zz": {"type": "integer"}},
              "propertyNames": {"pattern": pattern}}
    assert accepts(compiler, schema, obj) is want


def test_property_names_static_check_is_not_pythons_re(compiler):
    # Python's re: '^a$' matches "a\n", '^\d$' matches Arabic-Indic digits, '^\w$' matches "é".
    schema = {"type": "object", "properties": {"a": {}, "a\n": {}, "\u0663": {}, "3": {}, "\u00e9": {}, "e": {}},
              "propertyNames": {"anyOf": [{"pattern": "^a$"}, {"pattern": "^\\d$"}, {"pattern": "^\\w$"}]}}
    for key, ok in [("a", True), ("a\n", False), ("\u0663", False), ("3", True), ("\u00e9", False), ("e", True)]:
        assert accepts(compiler, schema, json.dumps({key: 1}, ensure_ascii=False, separators=(",", ":"))) is ok, key


@pytest.mark.parametrize("pattern, construct", [
    ("(?<=a)b", "(?<="), ("(a)\\1", "\\1"), ("(?i)a", "(?i)"), ("(?P<n>a)", "(?P"), ("\\a", "\\a"),
    ("a(^b)", "^"), ("(a$)b", "$"), ("(\\bx)+", "\\b"), ("a**", "a**"), ("[b-a]", "[b-a"),
    ("a?\\b" * 7, "\\b"),  # each boundary may split the branch in three: at most 6 a branch
])
def test_what_a_token_automaton_cannot_place_is_refused_at_the_pointer(compiler, pattern, construct):
    problem = check_pattern(pattern)
    assert problem is not None and problem.construct.startswith(construct), problem
    err = refused(compiler, {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}})
    assert err.path == "/properties/p/pattern"


def test_annex_b_leniencies_and_unicode_mode_escapes():
    assert search("^[\\w-.]+$", "a-b.c") and not search("^[\\w-.]+$", "a b")  # '-' beside a class escape
    assert search("^\\-\\_\\@$", "-_@")  # escaped punctuation is itself
    assert search("^a{,2}$", "a{,2}")  # a brace that starts no quantifier is literal
    assert search("^\\u{1F600}$", "\U0001F600") and search("^\\uD83D\\uDE00$", "\U0001F600")
    assert search("^\\cC$", "\x03") and search("^[\\b]$", "\x08") and search("^\\0$", "\x00")
    assert search("^\\p{Letter}+$", "\u00e9t\u00e9") and not search("^\\P{L}$", "a")
    assert not search("[]", "") and not search("[]", "a") and search("^[^]$", "\n")
    # word boundaries in the alternatives of an unanchored pattern
    assert search("\\bcat\\b|\\bdog\\b", "a dog.") and not search("\\bcat\\b|\\bdog\\b", "dogs, cats")
    # after $ only the empty string can follow: a part that can match it is dropped
    assert search("^a$(b)?", "a") and not search("^a$(b)?", "ab") and not search("^a$(b)?", "xa")


def test_the_llguidance_translation_is_anchored_and_keeps_nul_out_of_risky_sets():
    assert to_rust("abc").startswith("^(?:") and to_rust("abc").endswith(")$")
    # llguidance 1.9 lets \" through a set that has U+0000 but not both '"' and '\'
    assert "\\x{0}" not in to_rust('^[^"]+$') and "\\x{1}" in to_rust('^[^"]+$')
    assert to_rust("^[\\s\\S]$").count("\\x{0}") == 1  # all of them: left as it is


def test_a_quote_outside_the_class_is_still_refused_by_the_grammar(compiler):
    assert not accepts(compiler, {"type": "string", "pattern": '^[^"]+$'}, '"a\\"b"')
    assert accepts(compiler, {"type": "string", "pattern": '^[^"]+$'}, '"ab"')


# ---- numbers -----------------------------------------------------------------------------------

N = 2**53 + 1  # 9007199254740993: no double has this value
# (schema as JSON text, instance, what sgrt must do): "accept" (valid), "reject" (invalid), or
# "narrowed" (valid, rejected: a bound no double names was moved inward, or a member dropped).
NUMBER_ROWS = [
    (f'{{"type": "integer", "minimum": {N}}}', [(str(N - 1), "reject"), (str(N), "narrowed"), (str(N + 1), "accept")]),
    (f'{{"type": "integer", "maximum": {N}}}', [(str(N - 1), "accept"), (str(N), "narrowed"), (str(N + 1), "reject")]),
    (f'{{"type": "integer", "exclusiveMinimum": {N}}}', [(str(N), "reject"), (str(N + 1), "accept")]),
    (f'{{"type": "integer", "exclusiveMaximum": {N}}}', [(str(N - 1), "accept"), (str(N), "reject")]),
    (f'{{"type": "number", "minimum": {N}}}', [(str(N - 1), "reject"), (f"{N - 1}.5", "reject"),
                                               (f"{N}.5", "narrowed"), (str(N + 1), "accept")]),
    (f'{{"type": "number", "maximum": {N}}}', [(str(N - 1), "accept"), (f"{N}.5", "reject"), (str(N + 1), "reject")]),
    ('{"type": "number", "minimum": 0.1000000000000000000001}', [("0.1", "reject"), ("0.2", "accept")]),
    ('{"type": "number", "maximum": 0.1000000000000000000001}', [("0.1", "accept"), ("0.2", "reject")]),
    ('{"type": "number", "exclusiveMinimum": 0.1}', [("0.1", "reject"), ("0.1000000001", "accept")]),
    ('{"type": "number", "exclusiveMaximum": 2.5}', [("2.5", "reject"), ("2.4", "accept")]),
    ('{"type": "integer", "minimum": 2.5, "maximum": 4.5}', [("2", "reject"), ("3", "accept"), ("4", "accept"),
                                                           ("5", "reject")]),
    (f'{{"enum": [{N}, 1]}}', [(str(N - 1), "reject"), (str(N), "narrowed"), ("1", "accept"), (str(N + 1), "reject")]),
    ('{"enum": [0.1, 0.1000000000000000000001]}', [("0.1", "accept"), ("0.1000000000000000000001", "narrowed"),
                                                   ("0.10000000000000001", "reject")]),
    ('{"const": 0.1}', [("0.1", "accept"), ("0.10000000000000001", "reject")]),
    ('{"type": "integer", "allOf": [{"multipleOf": 3}, {"multipleOf": 5}]}',
     [("15", "accept"), ("-30", "accept"), ("3", "reject"), ("10", "reject")]),
    ('{"const": 1e2}', [("100", "accept"), ("101", "reject")]),
    (f'{{"type": "object", "properties": {{"a": {{"const": [1, {2**53}]}}}}, "required": ["a"]}}',
     [(f'{{"a":[1,{2**53}]}}', "accept"), (f'{{"a":[1,{2**53 + 2}]}}', "reject")]),
]


def _number_cases():
    for schema, rows in NUMBER_ROWS:
        for text, want in rows:
            yield schema, text, want


@pytest.mark.parametrize("schema, text, want", list(_number_cases()))
def test_numbers_compare_as_mathematical_values(compiler, schema, text, want):
    valid = exact_valid(schema, text)
    assert valid is (want != "reject"), "the row's label disagrees with JSON Schema"
    assert accepts(compiler, schema, text) is (want == "accept")
    # the same schema as a dict (floats read as their shortest decimal) where that is lossless
    as_dict = json.loads(schema)
    if json.loads(json.dumps(as_dict), parse_float=Decimal) == json.loads(schema, parse_float=Decimal):
        assert accepts(compiler, as_dict, text) is (want == "accept")


@pytest.mark.parametrize("schema, path", [
    (f'{{"const": {N}}}', "/const"),
    ('{"const": 0.1000000000000000000001}', "/const"),
    (f'{{"enum": [{N}, {N + 2}]}}', "/enum"),
    ('{"type": "integer", "minimum": 1e19}', "/minimum"),
    ('{"type": "number", "maximum": -1e19}', "/maximum"),
    ('{"type": "number", "multipleOf": 0.07}', "/multipleOf"),
    ('{"type": "number", "multipleOf": 0}', "/multipleOf"),
    # llguidance's lcm of 65536 and 65537 wraps past 2**32 to 65536 (it then accepted 65536)
    ('{"type": "integer", "minimum": 0, "maximum": 100000, "allOf": [{"multipleOf": 65536}, {"multipleOf": 65537}]}',
     "/allOf/1/multipleOf"),
    ('{"properties": {"x": {"type": "integer", "exclusiveMinimum": 9223372036854774784}}}',
     "/properties/x/exclusiveMinimum"),
])
def test_numbers_no_double_can_carry_are_refused_at_their_pointer(compiler, schema, path):
    assert refused(compiler, schema).path == path


def test_bounds_past_the_engine_range_on_their_open_side_are_narrowed(compiler):
    schema = '{"type": "integer", "maximum": 1e19}'
    assert accepts(compiler, schema, "5") and not accepts(compiler, schema, str(2**63))
    assert accepts(compiler, '{"type": "number", "minimum": -1e30, "maximum": 0}', "-12.5")


def test_a_number_const_and_a_string_const_are_cached_apart(compiler):
    assert accepts(compiler, '{"const": 0.5}', "0.5") and not accepts(compiler, '{"const": 0.5}', '"0.5"')
    assert accepts(compiler, {"const": "0.5"}, '"0.5"') and not accepts(compiler, {"const": "0.5"}, "0.5")


def test_nan_and_infinity_are_not_json(compiler):
    for text in ('{"minimum": NaN}', '{"const": Infinity}'):
        assert "not valid JSON" in str(refused(compiler, text))
    assert "not JSON" in str(refused(compiler, {"minimum": float("nan")}))
