"""Issue 5 on the default model: constrained requests through the Engine, end to end.

One module-scoped float32 engine; greedy unless a test says otherwise. The numbered tests are
the issue's "inputs that other engines got wrong" that need a model (1, 7, 8, 10, 11, 12; the
others are token-level tests in test_inputs.py), then a Lark grammar file, regexes, and the
generation test over 28 JSONSchemaBench schemas (up to two of each subset). A few run on both
backends (the outlines one per request, ``grammar_backend="outlines"``).
"""
from __future__ import annotations

import collections
import json
import re
import time

import jsonschema
import pytest

from bench.validity import instance_text, load_maskbench
from sgrt.engine import Engine, SamplingParams
from sgrt.errors import GrammarError

BACKENDS = ["llguidance", "outlines"]
COLOR_MAKER = {"type": "object", "properties": {"color": {"type": "string"}, "maker": {"type": "string"}},
               "required": ["color", "maker"]}
STRING_S = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}


@pytest.fixture(scope="module")
def engine(loaded_model):
    # NOTE: 256 running requests so the 200 samples of test 8 run as one batch; the pool holds the
    # generation test's 28 prompts (~6k tokens) and their outputs at once.
    eng = Engine(model=loaded_model, max_total_tokens=24576, max_running_requests=256)
    yield eng
    eng.shutdown()


def chat(engine: Engine, *turns: str) -> str:
    """A chat prompt from alternating user / assistant turns (ending with a user turn)."""
    roles = ["user", "assistant"]
    msgs = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return engine.tokenizer.apply_chat_template(msgs)


def eos_ids(engine: Engine) -> set[int]:
    return set(engine.tokenizer.eos_token_ids)


def validator(schema: dict) -> jsonschema.protocols.Validator:
    """A validator for the draft ``schema`` declares (``$schema``; 2020-12 if none), checking the
    formats jsonschema knows."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("backend", BACKENDS)
def test_1_object_closes_without_whitespace_runs(engine, backend):
    r = engine.generate(chat(engine, "Describe a car as JSON with its color and maker."),
                        SamplingParams(max_tokens=64, json_schema=COLOR_MAKER, grammar_backend=backend))
    assert (r.finish_reason, r.matched) == ("stop", "grammar"), (r.text, r.error)
    validator(COLOR_MAKER).validate(json.loads(r.text))
    pieces = [engine.tokenizer.decode([t]) for t in r.token_ids]
    # Compact by default: not one whitespace-only token, let alone a run of them.
    assert not [p for p in pieces if p and not p.strip()], pieces


@pytest.mark.parametrize("backend", BACKENDS)
def test_7_regex_batch_eos_allowed_where_accepting(engine, backend):
    prompts = [
        # Two examples of answering "1": this row reaches "1" and wants to stop there.
        chat(engine, "How many suns does Earth orbit?", "1", "How many heads does a person have?", "1",
             "How many moons does Earth have?"),
        chat(engine, "What is 0+1? Reply with just the number."),
        chat(engine, "Type 1."),
        chat(engine, "Write the digit one three times: 111"),
    ]
    params = SamplingParams(max_tokens=8, regex="[1]{1,3}", grammar_backend=backend)
    handles = [engine.submit(p, params) for p in prompts]  # one batch
    results = [h.result() for h in handles]
    ends = eos_ids(engine)
    for r in results:
        assert r.text in {"1", "11", "111"}, (r.text, r.finish_reason, r.error)
        assert r.finish_reason == "stop", (r.text, r.finish_reason)
        body = [t for t in r.token_ids if t not in ends]
        assert len(body) <= 3 and len(r.token_ids) <= 4  # a finished row never grows
        if r.text == "111":
            assert r.matched == "grammar"  # nothing may follow: finished by the grammar
        else:
            assert r.matched in ends and r.token_ids[-1] in ends  # EOS allowed in an accepting state
    assert results[0].text == "1", "the row that reaches 1 early stops there"


def test_8_regex_star_sampled_lengths_vary(engine):
    # 200 seeded samples at temperature 1, one batch. Stopping must not be forced at the first
    # accepting state (the empty string), so lengths spread.
    params = [SamplingParams(max_tokens=8, regex="a*", temperature=1.0, seed=i) for i in range(200)]
    prompt = chat(engine, "Write the letter a a few times.")
    handles = [engine.submit(prompt, p) for p in params]
    results = [h.result() for h in handles]
    for r in results:
        assert re.fullmatch("a*", r.text), r.text
        assert r.finish_reason in ("stop", "length"), (r.finish_reason, r.error)
        assert not r.incomplete  # every prefix of a* is a complete match
    lengths = collections.Counter(len(r.text) for r in results)
    assert len(lengths) > 2, lengths


def test_10_no_eos_inside_a_string(engine):
    # Two examples where the assistant stops inside the string teach the model to do so; the
    # mask must keep EOS out until the object is closed.
    prompt = chat(engine, "Say hi.", '{"s":"Hello! How can I help you today?', "Greet me.",
                  '{"s":"Hi there, nice to meet you!', "Say hello.")
    r = engine.generate(prompt, SamplingParams(max_tokens=96, json_schema=STRING_S, return_logprob=True,
                                               top_logprobs_num=1))
    ends = eos_ids(engine)
    wanted_end = [i for i, top in enumerate(r.output_top_logprobs) if top and top[0][0] in ends]
    assert wanted_end, "precondition: the model's own first choice is EOS somewhere inside the string"
    assert not ends & set(r.token_ids)
    assert (r.finish_reason, r.matched) == ("stop", "grammar"), (r.text, r.finish_reason)
    validator(STRING_S).validate(json.loads(r.text))


def test_11_lookahead_fails_that_request_only(engine):
    bad_schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=.{3,8}$)[a-z]+$"}},
                  "required": ["code"]}
    good = engine.submit(chat(engine, "Describe a car as JSON with its color and maker."),
                         SamplingParams(max_tokens=64, json_schema=COLOR_MAKER))
    next(iter(good))  # in flight: its first tokens are out
    bad = [engine.submit(chat(engine, "Give me a code as JSON."),
                         SamplingParams(max_tokens=16, json_schema=bad_schema, grammar_backend=b)) for b in BACKENDS]
    for handle in bad:
        with pytest.raises(GrammarError) as err:
            handle.result(timeout=60)
        assert "lookahead" in str(err.value) and err.value.path == "/properties/code/pattern"
    r = good.result(timeout=120)
    assert (r.finish_reason, r.matched) == ("stop", "grammar"), (r.text, r.error)
    validator(COLOR_MAKER).validate(json.loads(r.text))
    # And the engine keeps serving.
    r = engine.generate(chat(engine, "Type 1."), SamplingParams(max_tokens=4, regex="[1]{1,3}"))
    assert r.finish_reason == "stop"


@pytest.mark.parametrize("backend", BACKENDS)
def test_12_max_tokens_cuts_the_value(engine, backend):
    r = engine.generate(chat(engine, "Write one sentence about cats as JSON."),
                        SamplingParams(max_tokens=5, json_schema=STRING_S, grammar_backend=backend))
    assert r.finish_reason == "length" and r.matched is None
    assert r.incomplete and len(r.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)
    # Unconstrained requests are never flagged.
    r = engine.generate(chat(engine, "Write one sentence about cats."), SamplingParams(max_tokens=3))
    assert r.finish_reason == "length" and not r.incomplete


def test_grammar_file_output_is_accepted(engine, compiler):
    question = "Write a SQL query that selects the names of users older than 30 from the table users."
    r = engine.generate(chat(engine, question), SamplingParams(max_tokens=48, grammar="sql_select.lark"))
    assert (r.finish_reason, r.matched) == ("stop", "grammar"), (r.text, r.error)
    assert r.text.startswith("SELECT ")
    # The same grammar, fresh, takes the text's canonical tokenization.
    g = compiler.compile(SamplingParams(grammar="sql_select"))
    assert all(g.accept_token(t) for t in engine.tokenizer.encode(r.text)) and g.is_accepting(), r.text
    # outlines-core has no Lark: refused for this request, never run unconstrained.
    with pytest.raises(GrammarError):
        engine.generate(chat(engine, "SQL please."), SamplingParams(max_tokens=8, grammar="sql_select",
                                                                    grammar_backend="outlines"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_output_fullmatches(engine, backend):
    cases = [
        ("When did World War II end? Answer with a date in the form YYYY-MM-DD.", r"\d{4}-\d{2}-\d{2}"),
        ("What is the phone number of the White House? Format: (123) 456-7890.", r"\(\d{3}\) \d{3}-\d{4}"),
        ("Is the sky blue? Answer yes or no, then explain in a few words.", r"(yes|no), [a-z ]{1,40}\."),
    ]
    handles = [engine.submit(chat(engine, q), SamplingParams(max_tokens=24, regex=rx, grammar_backend=backend))
               for q, rx in cases]
    for (_, rx), h in zip(cases, handles):
        r = h.result()
        assert (r.finish_reason, r.matched) == ("stop", "grammar"), (r.text, r.error)
        assert re.fullmatch(rx, r.text), (rx, r.text)


# ---- the generation test ---------------------------------------------------------------------
# Selection (fixed): every 6th JSONSchemaBench schema in manifest order, starting at the second
# (index 1, 7, 13, ...), at most PER_SUBSET of each of the 15 subsets, skipping the ones our
# compiler refuses (counted): 28 schemas, two of each subset but JME and Synthesized (the walk
# meets one JME schema, and one of its two Synthesized ones is refused). It was every such schema
# until 50 compiled; the subsets are what differ (keywords, formats, nesting, sizes), so two of
# each keep the test's reach for less CPU time (fewer rows in the decode batch).
# Prompt: the schema's compact JSON (its first SCHEMA_CHARS characters) and, as an example, the
# corpus's shortest valid instance (first EXAMPLE_CHARS characters). NOTE: with the schema alone
# ("Return a minimal JSON object matching this schema"), the 135M model completes only about half
# of them within 256 tokens: greedy, it loops inside strings ("2022-01-01 2022-01-01 ...",
# "1000000...") until the 256-character string cap; one example turns most of those loops into
# short values (23 of these 28 complete; they are a subset of the 50 the test used before, of
# which 40 completed). Cost: ~6k prompt tokens and ~2.3k generated tokens (the 50: ~10k and ~4.4k).
PER_SUBSET = 2
NUM_SCHEMAS = 28
MIN_COMPLETED = 18
SCHEMA_CHARS = 300
EXAMPLE_CHARS = 400


def corpus_selection(compiler) -> tuple[list, list[str]]:
    chosen, refused = [], []
    per_subset: collections.Counter = collections.Counter()
    for case in load_maskbench()[1::6]:
        subset = case.name.split("/")[0]
        if per_subset[subset] == PER_SUBSET:
            continue
        try:
            compiler.compile(SamplingParams(json_schema=case.schema))
        except GrammarError:
            refused.append(case.name)
            continue
        per_subset[subset] += 1
        chosen.append(case)
    return chosen, refused


def corpus_prompt(engine: Engine, case) -> str:
    schema = json.dumps(case.schema, separators=(",", ":"), ensure_ascii=False)
    if len(schema) > SCHEMA_CHARS:
        schema = schema[:SCHEMA_CHARS] + " ..."
    examples = sorted((instance_text(data) for _, valid, data in case.tests if valid), key=len)
    example = f"\nExample of a valid object: {examples[0][:EXAMPLE_CHARS]}" if examples else ""
    return chat(engine, f"Return a minimal JSON object matching this schema: {schema}{example}")


def test_generation_on_corpus_schemas(engine, compiler):
    cases, refused = corpus_selection(compiler)
    assert len(cases) == NUM_SCHEMAS and len(refused) <= 5, refused
    params = [SamplingParams(max_tokens=256, json_schema=c.schema) for c in cases]
    t0 = time.perf_counter()
    handles = [engine.submit(corpus_prompt(engine, c), p) for c, p in zip(cases, params)]  # one batch
    results = [h.result() for h in handles]
    seconds = time.perf_counter() - t0
    completed, invalid = [], []
    for case, r in zip(cases, results):
        assert r.finish_reason in ("stop", "length"), (case.name, r.finish_reason, r.error)
        if r.finish_reason == "length":
            try:
                json.loads(r.text)
            except json.JSONDecodeError:
                assert r.incomplete, (case.name, r.text)  # a value cut short is flagged
            continue
        assert r.matched == "grammar", (case.name, r.matched, r.text)
        completed.append(case.name)
        errors = list(validator(case.schema).iter_errors(json.loads(r.text)))
        if errors:
            invalid.append((case.name, r.text, errors[0].message))
    print(f"\ngeneration test: {len(completed)} of {len(cases)} completed by the grammar, {len(invalid)} invalid, "
          f"{len(refused)} refused and skipped, {sum(len(r.token_ids) for r in results)} tokens, {seconds:.1f} s")
    assert not invalid
    assert len(completed) >= MIN_COMPLETED, (len(completed), [c.name for c, r in zip(cases, results)
                                                               if r.finish_reason != "stop"])


# Integer bounds past the 64-bit range (reported: both bounds below -2**63 crashed the process in
# llguidance; a minimum of 1e19 gave 9223372036854775807, which the schema rejects).
OUT_OF_RANGE_INTEGERS = [
    ({"type": "integer", "minimum": -2e19, "maximum": -1e19}, "/maximum"),
    ({"type": "integer", "minimum": -9.4e18, "maximum": -9.3e18}, "/maximum"),
    ({"type": "integer", "minimum": -2**63, "maximum": -2**63}, "/maximum"),
    ({"type": "integer", "exclusiveMaximum": -1e19}, "/exclusiveMaximum"),
    ({"type": "integer", "minimum": 1e19, "maximum": 2e19}, "/minimum"),
    ({"type": "integer", "minimum": 1e308, "maximum": 1.5e308}, "/minimum"),
    ({"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 2**63 - 1024}}}, "/properties/n/exclusiveMinimum"),
]


def test_integer_bounds_past_the_64_bit_range_are_refused_and_the_engine_lives(engine):
    """Every bound that leaves no value the grammar engine can generate fails its request with a
    GrammarError naming the keyword's pointer; the engine keeps serving."""
    for schema, path in OUT_OF_RANGE_INTEGERS:
        with pytest.raises(GrammarError) as err:
            engine.generate(chat(engine, "Give me a number."), SamplingParams(max_tokens=8, json_schema=schema))
        assert err.value.path == path and "2**63 - 1024" in str(err.value), (schema, err.value)
    r = engine.generate(chat(engine, "Type 1."), SamplingParams(max_tokens=4, regex="[1]{1,3}"))
    assert r.finish_reason == "stop"


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": -2e19, "maximum": -5},
    {"type": "integer", "exclusiveMinimum": -1e30, "maximum": 7},
    {"type": "integer", "minimum": 3, "maximum": 2e19},
])
def test_open_side_bounds_past_the_64_bit_range_still_give_valid_integers(engine, schema):
    """A bound past the range on its open side is narrowed to the range: the output is valid."""
    r = engine.generate(chat(engine, "Give me a number."), SamplingParams(max_tokens=24, json_schema=schema))
    assert r.finish_reason == "stop", (r.text, r.error)
    value = json.loads(r.text)
    assert isinstance(value, int)
    validator(schema).validate(value)


@pytest.mark.parametrize("regex", ["\\", "a\\", "[0-9]+\\\\\\"])
def test_a_regex_ending_in_a_lone_backslash_is_refused(engine, regex):
    """Reported: ``a\\`` was accepted and generated ``a``; an escape with nothing to escape is a
    GrammarError naming regex (an escaped backslash at the end stays valid, below)."""
    with pytest.raises(GrammarError, match="lone backslash") as err:
        engine.generate("x", SamplingParams(max_tokens=4, regex=regex))
    assert err.value.field == "regex"
    r = engine.generate("Type a backslash:", SamplingParams(max_tokens=4, regex="a\\\\"))
    assert r.text == "a\\"
