"""gen / select / roles: argument checking and parameter inheritance (no model)."""
from __future__ import annotations

import pytest

import sgrt
from sgrt.errors import InvalidRequest
from sgrt.lang import ir
from sgrt.lang.defaults import GEN_DEFAULTS, dtype_regex, merge_run_options, resolve_gen_params


def test_gen_records_only_explicit_options():
    g = sgrt.gen("x", max_tokens=5, stop="\n")
    assert isinstance(g, ir.Gen)
    assert g.params == {"max_tokens": 5, "stop": ["\n"]}


def test_misspelled_keyword_is_type_error():
    with pytest.raises(TypeError):
        sgrt.gen("x", max_token=5)
    with pytest.raises(TypeError):
        sgrt.select("x", choices=["a"], choice_method=None)


def test_dtype_and_regex_is_an_error():
    with pytest.raises(InvalidRequest) as e:
        sgrt.gen("x", dtype=int, regex="[0-9]+")
    assert e.value.field == "dtype"


def test_bad_dtype():
    with pytest.raises(InvalidRequest) as e:
        sgrt.gen("x", dtype=list)
    assert e.value.field == "dtype"


def test_constraints_pass_through_unchecked():
    # The engine compiles constraints (its regex dialect is not Python's re).
    assert sgrt.gen("x", regex=r"\p{L}+").params == {"regex": r"\p{L}+"}


def test_two_constraints_is_an_error():
    with pytest.raises(InvalidRequest):
        sgrt.gen("x", regex="a", grammar="start: 'a'")


def test_gen_choices_is_select():
    g = sgrt.gen("x", choices=["a", "b"])
    assert isinstance(g, ir.Select) and g.choices == ["a", "b"]
    with pytest.raises(InvalidRequest):
        sgrt.gen("x", choices=["a"], max_tokens=3)


def test_select_checks():
    with pytest.raises(InvalidRequest):
        sgrt.select("x", [])
    with pytest.raises(InvalidRequest):
        sgrt.select("x", ["a", ""])
    with pytest.raises(InvalidRequest):
        sgrt.select("x", ["a"], temperature=0.5)


def test_gen_int_and_string_are_dtype_gens():
    assert sgrt.gen_int("n").dtype is int
    assert sgrt.gen_string("s", max_tokens=8).dtype is str


def test_defaults_are_greedy_and_inherit():
    assert GEN_DEFAULTS["temperature"] == 0.0
    p = resolve_gen_params({}, {})
    assert p["temperature"] == 0.0 and p["max_tokens"] == 128 and p["stop"] == []
    p = resolve_gen_params({"temperature": 0.7, "max_tokens": 16}, {"max_tokens": 4})
    assert p["temperature"] == 0.7 and p["max_tokens"] == 4


def test_run_options_aliases_and_unknown():
    assert merge_run_options({"max_new_tokens": 9}) == {"max_tokens": 9}
    with pytest.raises(TypeError):
        merge_run_options({"temprature": 1.0})
    with pytest.raises(TypeError):
        merge_run_options({"max_new_tokens": 1, "max_tokens": 2})


def test_dtype_regexes_are_bounded():
    import re

    s = dtype_regex(str)
    assert re.fullmatch(s, '"' + "a" * 10 + '"')
    assert not re.fullmatch(s, '"' + "a" * 10_000 + '"')
    assert re.fullmatch(dtype_regex("int"), "-42")
    assert re.fullmatch(dtype_regex(bool), "True")
    assert re.fullmatch(dtype_regex(float), "3.25")


def test_expression_concatenation():
    e = "Q: " + sgrt.gen("a") + "\n"
    assert [type(x).__name__ for x in e.flatten()] == ["ConstantText", "Gen", "ConstantText"]
    assert ir.var_names(sgrt.user("x") + sgrt.gen("a") + sgrt.select("b", ["y"])) == ["a", "b"]
    with pytest.raises(TypeError):
        ir.to_expr(None)
    with pytest.raises(InvalidRequest):
        ir.RoleBegin("wizard")
