"""Jump-forward (DESIGN.md): exact mode verifies the grammar's forced run as a draft, so greedy
output is token-identical to decoding without it; text mode appends the run unverified and its
outputs still validate. Forced tokens are reported per request."""
from __future__ import annotations

import json

import jsonschema
import pytest

from sgrt.engine import Engine, SamplingParams
from tests.engine.conftest import chat

CASES = [
    ("Return JSON for: Alice is 30 years old and lives in Paris.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"type": "string"}},
      "required": ["name", "age", "city"]}),
    ("Describe the movie Inception (2010, science fiction, thriller) as JSON.",
     {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                       "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
      "required": ["title", "year", "genres"]}),
    ("Classify the sentiment of 'I love this product!' as JSON.",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                       "confidence": {"type": "number"}},
      "required": ["sentiment", "confidence"]}),
    ("Order 1042 has shipped. Give its status as JSON.",
     {"type": "object", "properties": {"order": {"type": "object", "properties": {
         "order_id": {"type": "integer"}, "status": {"const": "shipped"}, "carrier_name": {"type": "string"}},
         "required": ["order_id", "status", "carrier_name"]}},
      "required": ["order"]}),
]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def engine(loaded_model):
    eng = Engine(model=loaded_model, max_total_tokens=4096)
    yield eng
    eng.shutdown()


def run(engine: Engine, mode: str | None, **kw) -> list:
    handles = [engine.submit(chat(engine.tokenizer, q), SamplingParams(max_tokens=MAX_TOKENS, json_schema=s,
                                                                       jump_forward=mode, **kw))
               for q, s in CASES]
    return [h.result() for h in handles]


@pytest.fixture(scope="module")
def without(engine):
    return run(engine, None)


def assert_valid(results: list) -> None:
    for r, (_, schema) in zip(results, CASES):
        assert r.finish_reason == "stop" and r.matched == "grammar", (r.text, r.error)
        jsonschema.validate(json.loads(r.text), schema)


def test_exact_jump_forward_is_token_identical(engine, without):
    exact = run(engine, "exact")
    for plain, jf in zip(without, exact):
        assert jf.token_ids == plain.token_ids, (plain.text, jf.text)
        assert jf.forced_tokens > 0 and plain.forced_tokens == 0
        assert jf.spec_drafted == 0  # forced runs are not counted as speculation
    assert_valid(exact)
    engine.flush_cache()
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots


def test_text_jump_forward_outputs_validate(engine, without):
    text = run(engine, "text")
    assert_valid(text)
    assert all(r.forced_tokens > 0 for r in text)
    # Asking for logprobs turns text mode into exact (unverified tokens have no logprobs).
    q, schema = CASES[0]
    r = engine.generate(chat(engine.tokenizer, q), SamplingParams(max_tokens=MAX_TOKENS, json_schema=schema,
                                                                  jump_forward="text", return_logprob=True))
    assert r.token_ids == without[0].token_ids and len(r.output_logprobs) == len(r.token_ids)
    engine.flush_cache()
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots


def test_exact_jump_forward_with_sampling_and_speculation(engine):
    sampled = run(engine, "exact", temperature=0.8, seed=5)
    assert_valid(sampled)
    assert sum(r.forced_tokens for r in sampled) > 0
    spec = run(engine, "exact", speculative="ngram")
    assert_valid(spec)
    unconstrained = engine.generate(chat(engine.tokenizer, CASES[0][0]), SamplingParams(max_tokens=8))
    assert unconstrained.forced_tokens == 0
    engine.flush_cache()
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots
