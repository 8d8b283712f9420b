"""Engine behaviour on the default model (float32): batching invariance, cache, chunking,
memory pressure, abort, logprobs, stop conditions and errors."""
from __future__ import annotations

import asyncio

import pytest
import torch

from sgrt.engine import Engine, EngineConfig, SamplingParams
from sgrt.errors import CapacityError, ContextLengthExceeded, GrammarError, InvalidRequest
from tests.engine.conftest import assert_same_greedy, chat

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Give me a name for a cat.",
    "What color is the sky on a clear day?",
    "Translate 'good morning' into Spanish.",
    "Why do leaves fall in autumn?",
]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, return_logprob=True, top_logprobs_num=5, **kw)


def mixed_requests(tokenizer) -> list[tuple[str, SamplingParams]]:
    reqs = []
    for i in range(16):
        q = QUESTIONS[i % len(QUESTIONS)]
        # Longer, distinct prompts for half of them so prefill lengths differ a lot.
        if i % 2:
            q = f"Context: {' '.join(QUESTIONS)} (request {i}). Now answer: {q}"
        reqs.append((chat(tokenizer, q), greedy(8 + (i * 5) % 24)))
    return reqs


def test_generate_answers_and_reports_metrics(engine):
    r = engine.generate(chat(engine.tokenizer, "What is the capital of France?"), SamplingParams(max_tokens=24))
    assert "Paris" in r.text
    assert r.finish_reason == "stop" and r.matched in engine.tokenizer.eos_token_ids
    assert r.prompt_tokens == len(r.prompt_token_ids) > 10
    assert r.completion_tokens == len(r.token_ids)
    assert 0 < r.ttft <= r.total_time


def test_batch_cache_and_chunking_do_not_change_greedy_output(loaded_model):
    base = Engine(model=loaded_model, max_total_tokens=8192, enable_radix_cache=False)
    reqs = mixed_requests(base.tokenizer)
    try:
        alone = [base.generate(p, s) for p, s in reqs]
    finally:
        base.shutdown()
    for chunk in (16, 64, 512):
        eng = Engine(model=loaded_model, max_total_tokens=8192, chunked_prefill_size=chunk, max_prefill_tokens=chunk)
        try:
            start_free = eng.pool.num_free
            handles = [eng.submit(p, s) for p, s in reqs]  # one batch of 16
            batched = [h.result() for h in handles]
            again = [h.result() for h in [eng.submit(p, s) for p, s in reqs[:4]]]  # cache hits
            for a, b in zip(alone, batched):
                assert_same_greedy(a, b)
            for a, b in zip(alone, again):
                assert b.cached_tokens > 0
                assert_same_greedy(a, b)
            eng.check_integrity()
            eng.flush_cache()
            assert eng.pool.num_free == start_free
        finally:
            eng.shutdown()


def test_memory_pressure_retracts_and_loses_nothing(loaded_model, engine):
    reqs = mixed_requests(engine.tokenizer)[:8]
    reqs = [(p, greedy(32, ignore_eos=True)) for p, _ in reqs]
    reference = [engine.generate(p, s) for p, s in reqs]
    need = max(len(engine.tokenizer.encode(p)) for p, _ in reqs) + 32
    small = Engine(model=loaded_model, max_total_tokens=need + 64, max_running_requests=8)
    try:
        results = small.generate_batch([p for p, _ in reqs], reqs[0][1])
        assert small.stats()["retracted"] > 0
        for ref, got in zip(reference, results):
            assert got.finish_reason == "length" and len(got.token_ids) == 32
            assert_same_greedy(ref, got)
        small.check_integrity()
        small.flush_cache()
        assert small.pool.num_free == small.pool.num_slots
        with pytest.raises(CapacityError, match="max_total_tokens"):
            small.submit("hello " * 50, SamplingParams(max_tokens=small.pool.num_slots))
    finally:
        small.shutdown()


def test_abort_frees_slots(engine):
    engine.flush_cache()
    free = engine.pool.num_free
    h = engine.submit(chat(engine.tokenizer, "Tell me a long story."), SamplingParams(max_tokens=500, ignore_eos=True))
    for chunk in h:
        if len(chunk.token_ids) and h.done is False:
            break
    h.abort()
    r = h.result(timeout=60)
    assert r.finish_reason == "abort"
    assert r.completion_tokens < 500
    engine.flush_cache()
    assert engine.pool.num_free == free
    engine.check_integrity()


def test_prompt_logprobs_match_a_full_forward(engine, loaded_model):
    text = "The quick brown fox jumps over the lazy dog."
    ids = engine.tokenizer.encode(text)
    r = engine.generate(ids, SamplingParams(max_tokens=0, return_logprob=True, logprob_start_len=0))
    assert r.completion_tokens == 0 and r.finish_reason == "length"
    ref = torch.log_softmax(loaded_model.model.forward_simple(torch.tensor(ids)), dim=-1)
    expected = [None] + [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert r.prompt_logprobs[0] is None
    assert len(r.prompt_logprobs) == len(ids)
    for got, want in zip(r.prompt_logprobs[1:], expected[1:]):
        assert abs(got - want) < 1e-4
    # From a later start, with the prompt now cached: same values, recomputed.
    # From position 0 again, now that the prompt is cached: recomputed, same values.
    r1 = engine.generate(ids, SamplingParams(max_tokens=0, return_logprob=True, logprob_start_len=0))
    assert len(r1.prompt_logprobs) == len(ids)
    for got, want in zip(r1.prompt_logprobs[1:], expected[1:]):
        assert abs(got - want) < 1e-4
    r2 = engine.generate(ids, SamplingParams(max_tokens=0, return_logprob=True, logprob_start_len=4))
    assert len(r2.prompt_logprobs) == len(ids) - 4
    for got, want in zip(r2.prompt_logprobs, expected[4:]):
        assert abs(got - want) < 1e-4


def test_prefill_only_request_caches_the_prompt(engine):
    engine.flush_cache()
    prompt = chat(engine.tokenizer, "Summarise the plot of Hamlet. " * 6)
    n = len(engine.tokenizer.encode(prompt))
    engine.generate(prompt, SamplingParams(max_tokens=0))
    r = engine.generate(prompt, SamplingParams(max_tokens=4))
    assert r.cached_tokens == n - 1  # all but the last token, which must run for logits


def test_shared_prefix_is_prefilled_once_in_a_batch(loaded_model):
    eng = Engine(model=loaded_model, max_total_tokens=8192)
    try:
        shared = "You are a careful assistant. " * 40
        prompts = [shared + f"Question {i}: what is {i} plus {i}?" for i in range(4)]
        n_shared = len(eng.tokenizer.encode(shared))
        results = eng.generate_batch(prompts, SamplingParams(max_tokens=2))
        total_prompt = sum(r.prompt_tokens for r in results)
        computed = eng.stats()["prefill_tokens"]
        assert computed < total_prompt - 2 * n_shared  # at least two of four reused it
    finally:
        eng.shutdown()


def test_stop_string_across_tokens(engine):
    prompt = chat(engine.tokenizer, "Write two sentences about the ocean.")
    full = engine.generate(prompt, SamplingParams(max_tokens=40))
    # A stop string that straddles the boundary between output tokens 5 and 6.
    boundary = len(engine.tokenizer.decode(full.token_ids[:6]))
    stop = full.text[boundary - 2: boundary + 3]
    assert len(stop) == 5
    cut = engine.generate(prompt, SamplingParams(max_tokens=40, stop=[stop]))
    assert cut.finish_reason == "stop" and cut.matched == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text
    chunks = list(engine.stream(prompt, SamplingParams(max_tokens=40, stop=[stop])))
    assert "".join(c.text for c in chunks) == cut.text


def test_stream_concatenates_to_result_and_async_works(engine):
    prompt = chat(engine.tokenizer, "Say hello in French.")
    chunks = list(engine.stream(prompt, SamplingParams(max_tokens=16, return_logprob=True)))
    final = chunks[-1].result
    assert chunks[-1].finished
    assert "".join(c.text for c in chunks) == final.text
    assert sum(len(c.token_ids) for c in chunks) == len(final.token_ids)
    for c in chunks:
        assert len(c.logprobs) == len(c.token_ids)

    async def run():
        return await asyncio.gather(*(engine.agenerate(prompt, SamplingParams(max_tokens=16)) for _ in range(3)))

    results = asyncio.run(run())
    assert all(r.text == final.text for r in results)


def test_seed_and_sampling(engine):
    prompt = chat(engine.tokenizer, "Write a short poem.")
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    a, b = engine.generate(prompt, p), engine.generate(prompt, p)
    assert a.token_ids == b.token_ids
    texts = {engine.generate(prompt, p.replace(seed=s)).text for s in range(4)}
    assert len(texts) > 1


def test_min_tokens_and_stop_token_ids(engine):
    prompt = chat(engine.tokenizer, "What is the capital of France?")
    short = engine.generate(prompt, SamplingParams(max_tokens=20))
    assert short.finish_reason == "stop"
    longer = engine.generate(prompt, SamplingParams(max_tokens=20, min_tokens=len(short.token_ids) + 3))
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    first = short.token_ids[0]
    r = engine.generate(prompt, SamplingParams(max_tokens=20, stop_token_ids=[first]))
    assert r.token_ids == [first] and r.matched == first


def test_invalid_requests_name_the_field(engine):
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.submit("hi", SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.submit("hi", {"top_p": 1.5})
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.submit("hi", {"max_tokens": -1})
    with pytest.raises(InvalidRequest, match="tempreature"):
        engine.submit("hi", {"tempreature": 0.5})
    with pytest.raises(InvalidRequest, match="prompt"):
        engine.submit([1, 2, 10**9])
    for text in ("a\ud800b", "\udfff"):  # lone surrogates: not UTF-8, reported as a raw TypeError
        with pytest.raises(InvalidRequest, match="not valid Unicode") as info:
            engine.submit(text)
        assert info.value.field == "prompt"


@pytest.mark.parametrize("field,value", [
    ("skip_special_tokens", 5), ("ignore_eos", 1), ("return_logprob", "yes"), ("no_stop_trim", None),
    ("stop", 5), ("stop", True), ("stop_token_ids", 1.5), ("stop_token_ids", "12"), ("grammar_backend", 3),
])
def test_wrongly_typed_fields_are_refused_before_the_engine(engine, field, value):
    """Every flag must be a bool and every list a list (reported: ``skip_special_tokens: 5``
    reached the tokenizer inside the engine loop); the error names the field."""
    with pytest.raises(InvalidRequest, match=field) as info:
        engine.submit("hi", {"max_tokens": 2, field: value})
    assert info.value.field == field


def test_a_request_whose_detokenizer_raises_fails_alone(engine):
    """A request that fails inside the loop (here its detokenizer, forced to raise) ends failed,
    and the engine goes on serving: the next request's greedy answer is the one it gave before."""
    before = engine.generate("Say hi", {"max_tokens": 4})
    params = SamplingParams(max_tokens=4)
    object.__setattr__(params, "skip_special_tokens", 5)  # past validation, as a bug would be
    with pytest.raises(Exception):
        engine.generate("Say hi", params)
    assert engine.is_alive()
    after = engine.generate("Say hi", {"max_tokens": 4})
    assert after.token_ids == before.token_ids and after.text == before.text


def test_context_length(engine):
    ids = list(range(100, 100 + engine.context_length + 10))
    with pytest.raises(ContextLengthExceeded, match="truncate"):
        engine.submit(ids, SamplingParams(max_tokens=4))
    kept = engine.intake.fit_context(ids, SamplingParams(max_tokens=4, truncate="left"))
    assert kept == ids[-(engine.context_length - 4):]


def test_options_are_checked_when_the_engine_is_built():
    # The config is checked before the model loads: a bad option fails at Engine(...) even
    # with a model path that does not exist.
    missing = "/nonexistent/model.gguf"
    with pytest.raises(GrammarError, match="grammar_backend"):
        Engine(model=missing, grammar_backend="xgrammar")
    with pytest.raises(InvalidRequest, match="schedule_policy"):
        Engine(model=missing, schedule_policy="lifo")
    with pytest.raises(InvalidRequest, match="max_total_tokens"):
        Engine(model=missing, max_total_tokens=0)
    with pytest.raises(InvalidRequest, match="max_jump_forward_tokens"):
        Engine(model=missing, max_jump_forward_tokens=-1)
    with pytest.raises(TypeError, match="extra"):
        Engine(model=missing, extra={})
    cfg = EngineConfig.from_options(max_running_requests=3, speculative="ngram", max_total_tokens=512)
    assert cfg.scheduler.max_running_requests == 3 and cfg.spec.speculative == "ngram"
    assert cfg.max_total_tokens == 512 and cfg.scheduler.chunked_prefill_size == 512
