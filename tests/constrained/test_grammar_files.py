"""grammars/*.lark: the shipped Lark grammars, fed token by token (llguidance)."""
from __future__ import annotations

import pytest

from sgrt.constrained import grammar_files, load_grammar_text
from sgrt.engine.sampling_params import SamplingParams
from sgrt.errors import GrammarError

from .util import feed

CASES = {
    "json": (['{"a":[1,2.5e3,{"b":null}],"c":"x\\"y"}', "[]", "true", '"\\u00e9"'], ['{"a": 1}', "{'a':1}", "[1,]"]),
    "arithmetic": (["1 + 2*(3 - 4.5)", "-(2)/3", "42"], ["1  + 2", "1+", "(1"]),
    "sql_select": ([
        "SELECT name, COUNT(*) AS n FROM users AS u JOIN orders AS o ON u.id = o.user_id "
        "WHERE age > 30 AND city = 'Paris' GROUP BY name ORDER BY n DESC LIMIT 10;",
        "SELECT * FROM t",
        "SELECT DISTINCT a FROM t WHERE b IS NOT NULL AND c IN (1, 2)",
    ], ["select * from t", "SELECT FROM t", "SELECT * FROM t WHERE"]),
    "function_call": ([
        'get_weather(city="Paris", days=3)',
        'search(query="llm", filters={"year": 2024, "tags": ["a", "b"]}, exact=True)\nnoop()',
    ], ["f(x=)", "f(", 'f("a)']),
}


def test_all_files_shipped():
    assert set(CASES) <= set(grammar_files())


@pytest.mark.parametrize("name", sorted(CASES))
def test_grammar_file(compiler, tokenizer, name):
    good, bad = CASES[name]
    for spec in (name, name + ".lark"):
        g = compiler.compile(SamplingParams(grammar=spec))
        for text in good:
            assert feed(g, tokenizer.encode(text)), (spec, text)
        for text in bad:
            assert not feed(g, tokenizer.encode(text)), (spec, text)


def test_inline_lark_and_missing_file(compiler, tokenizer):
    g = compiler.compile(SamplingParams(grammar='start: "yes" | "no"'))
    assert feed(g, tokenizer.encode("yes")) and not feed(g, tokenizer.encode("maybe"))
    with pytest.raises(GrammarError) as err:
        load_grammar_text("nosuchgrammar")
    assert err.value.field == "grammar"
    with pytest.raises(GrammarError):
        compiler.compile(SamplingParams(grammar="start: (("))
