"""Speculative decoding (sgrt/engine/speculative.py, verify.py, drafters.py): greedy output is
unchanged (n-gram and draft-model drafters), rejection sampling keeps the target distribution,
KV slots and grammar state survive rejected drafts, stop conditions are checked token by token,
and speculation turns itself off under load."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from sgrt.engine import Engine, SamplingParams
from sgrt.engine.drafters import NgramIndex
from sgrt.engine.request import Req
from sgrt.engine.sampler import sampling_probs
from sgrt.engine.speculative import SpecState, plan_draft_lengths
from sgrt.engine.verify import Draft, verify
from sgrt.errors import InvalidRequest
from tests.engine.conftest import assert_same_greedy, chat

COPY = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "Return these records as JSON lines with keys name and city: name=Alice Smith, city=Paris; "
    "name=Bob Jones, city=Berlin; name=Carol White, city=Madrid.",
    "Rename the function to add_numbers and return the code:\ndef sum_two(first_value, second_value):\n"
    "    result = first_value + second_value\n    return result",
]
FREE = ["Write a haiku about the sea.", "Give me a name for a cat."]
MAX_TOKENS = 40


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, return_logprob=True, top_logprobs_num=5, **kw)


def tiny_draft_model(target):
    """A randomly initialised 2-layer Llama with the target's vocabulary and tokenizer."""
    from sgrt.models import LoadedModel, ModelConfig
    from sgrt.models.llama import LlamaForCausalLM

    cfg = ModelConfig(vocab_size=target.config.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=target.config.max_position_embeddings)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return LoadedModel(model=model, config=cfg, tokenizer=target.tokenizer, path=target.path,
                       source="random:tiny", load_seconds=0.0)


@pytest.fixture(scope="module")
def engine(loaded_model):
    eng = Engine(model=loaded_model, max_total_tokens=4096, draft_model=tiny_draft_model(loaded_model),
                 draft_max_total_tokens=2048)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(engine):
    return [chat(engine.tokenizer, q) for q in COPY + FREE]


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """Plain greedy outputs (no speculation), in one batch."""
    return engine.generate_batch(prompts, greedy())


def assert_pool_whole(eng: Engine) -> None:
    eng.flush_cache()
    eng.check_integrity()
    assert eng.pool.num_free == eng.pool.num_slots
    drafter = eng.spec.drafter
    if drafter is not None:
        assert drafter.num_held() == 0 and drafter.pool.num_free == drafter.pool.num_slots


# -- unit level --------------------------------------------------------------------------------
def test_ngram_index_proposes_the_most_recent_continuation():
    idx = NgramIndex()
    ids = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert idx.propose(ids, 3) == ([7, 8, 2], 3)  # "2 3 4" last seen before the suffix at 6..8
    assert idx.propose(ids + [7], 2) == ([8, 2], 3)  # incremental: only new tokens indexed
    assert NgramIndex().propose([5, 6, 7], 4) == ([], 0)  # no earlier occurrence of any suffix
    assert NgramIndex().propose([5, 6, 5], 4) == ([6, 5], 1)  # falls back to n = 1


def test_greedy_verify_accepts_the_matching_prefix_plus_one():
    logits = torch.full((4, 10), -5.0)
    for j, t in enumerate([3, 4, 6, 8]):  # target argmax per position
        logits[j, t] = 5.0
    req = Req("r", [1, 2], SamplingParams())
    out = verify(logits, req, Draft(tokens=[3, 4, 5]), set())
    assert out.tokens == [3, 4, 6] and out.num_accepted == 2
    out = verify(logits, req, Draft(tokens=[3, 4, 6]), set())
    assert out.tokens == [3, 4, 6, 8] and out.num_accepted == 3  # all accepted + bonus
    out = verify(logits, req, Draft(tokens=[3, 4, 6], terminal=True), set())
    assert out.tokens == [3, 4, 6]  # the grammar ends after the draft: no bonus token
    out = verify(logits, req, Draft(tokens=[0]), set())
    assert out.tokens == [3] and out.num_accepted == 0


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    keep = p > 0
    assert float(counts[~keep].sum()) == 0, "a token the target gives probability 0 was emitted"
    return float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())


@pytest.mark.parametrize("draft_kind", ["model", "point"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    """8 tokens, 20k trials, temperature + top-k + top-p processing: the first emitted token
    follows p0 and the second (after an accepted draft) follows p1 (chi-square df <= 7 at
    p = 0.001: 24.3; total variation < 0.02)."""
    v, n = 8, 20_000
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(3, v, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=7, top_p=0.95)
    p = torch.stack([sampling_probs(logits[j], params) for j in range(3)])
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(2, v, generator=g), -1)
    req = Req("r", [1], params)
    req.generator = torch.Generator().manual_seed(7)
    first = torch.zeros(v)
    second = torch.zeros(v)
    fixed = int(torch.argsort(p[0], descending=True)[1])  # a point-mass draft: the runner-up
    for _ in range(n):
        if draft_kind == "model":
            d = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
            draft = Draft(tokens=d, probs=q)
        else:
            draft = Draft(tokens=[fixed, int(torch.argmax(p[1]))])
        out = verify(logits, req, draft, set())
        first[out.tokens[0]] += 1
        if out.num_accepted >= 1:
            second[out.tokens[1]] += 1
    assert _tv(first, p[0]) < 0.02 and _chi2(first, p[0]) < 24.3
    assert second.sum() > 1000
    assert _tv(second, p[1]) < 0.03 and _chi2(second, p[1]) < 24.3


def test_acceptance_estimate_and_draft_lengths():
    s = SpecState()
    assert abs(s.alpha(3) - 0.5) < 1e-9  # the prior
    for _ in range(5):
        s.update(3, drafted=4, accepted=4)
    high = s.alpha(3)
    assert high > 0.9 and abs(s.alpha(1) - 0.5) < 1e-9  # one estimate per draft source
    for _ in range(10):
        s.update(3, drafted=4, accepted=0)
    assert s.alpha(3) < min(high, 0.5)
    for _ in range(40):
        s.update(3, drafted=1, accepted=0)
    low = s.alpha(3)
    assert low < 0.1
    for _ in range(20):
        s.idle()
    assert low < s.alpha(3)  # no drafts for a while: the estimate drifts back up...
    for _ in range(200):
        s.idle()
    assert abs(s.alpha(3) - 0.5) < 0.01  # ...to the prior, and a probe goes out

    cpu = (0.37, 0.055)
    # Batch 1: a well-accepted request gets its full length; a poor one none (a draft must pay
    # for the switch to a multi-token forward); a middling one a short draft.
    assert plan_draft_lengths([0.95], [8], 1, 1, cpu) == [8]
    assert plan_draft_lengths([0.3], [8], 1, 1, cpu) == [0]
    assert 1 <= plan_draft_lengths([0.5], [8], 1, 1, cpu)[0] < 8
    assert plan_draft_lengths([0.95], [3], 1, 1, cpu) == [3]  # capped
    assert plan_draft_lengths([0.3], [8], 1, 1, (0.0, 0.055))[0] >= 1  # no switch cost: drafts pay
    # The draft tokens go to the requests that accept most.
    two = plan_draft_lengths([0.9, 0.2], [8, 8], 2, 2, cpu)
    assert two[0] > 0 and two[1] == 0
    # A large batch turns speculation off: the first token must beat g*B / (1 + g*(B - 1)).
    assert sum(plan_draft_lengths([0.6] * 8, [8] * 8, 8, 8, cpu)) > 0
    assert plan_draft_lengths([0.6] * 32, [8] * 32, 32, 32, cpu) == [0] * 32  # bar 0.65
    assert plan_draft_lengths([0.8] * 80, [8] * 80, 80, 80, cpu) == [0] * 80  # bar 0.82


# -- on the default model ----------------------------------------------------------------------
def test_ngram_greedy_equals_plain_greedy(engine, prompts, reference):
    got = engine.generate_batch(prompts, greedy(speculative="ngram"))
    for ref, res in zip(reference, got):
        assert_same_greedy(ref, res)
        if ref.token_ids == res.token_ids:  # logprobs come from the verify forward: same values
            assert max(abs(a - b) for a, b in zip(ref.output_logprobs, res.output_logprobs)) < 1e-3
        assert res.spec_accepted <= res.spec_drafted
    copy = got[: len(COPY)]
    assert sum(r.spec_accepted for r in copy) > 0.4 * sum(r.spec_drafted for r in copy) > 0
    assert all(r.spec_accepted > 0 for r in copy)
    assert engine.stats()["spec_accepted"] >= sum(r.spec_accepted for r in got)
    assert_pool_whole(engine)


def test_draft_model_greedy_equals_plain_greedy(engine, prompts, reference):
    got = engine.generate_batch(prompts[:2], greedy(speculative="draft", num_draft_tokens=3))
    for ref, res in zip(reference, got):
        assert_same_greedy(ref, res)
        assert res.spec_drafted > 0  # a random draft model: nearly all rejected, output unchanged
    # Sampling with draft distributions q (rejection sampling with p / q) runs cleanly too.
    sampled = engine.generate(prompts[0], SamplingParams(max_tokens=16, temperature=1.0, seed=1,
                                                         speculative="draft"))
    assert sampled.completion_tokens > 0 and sampled.spec_drafted > 0
    assert_pool_whole(engine)


def test_target_as_its_own_draft_model_accepts_nearly_everything(loaded_model, prompts, reference):
    eng = Engine(model=loaded_model, max_total_tokens=2048, speculative="draft", draft_model=loaded_model,
                 draft_max_total_tokens=1024, num_draft_tokens=4)
    try:
        res = eng.generate(prompts[-2], greedy(MAX_TOKENS))
        ref = reference[-2]
        assert_same_greedy(ref, res)
        assert res.spec_drafted > 0 and res.spec_accepted >= 0.9 * res.spec_drafted
        assert_pool_whole(eng)
    finally:
        eng.shutdown()


def test_stop_string_and_max_tokens_inside_accepted_drafts(engine, prompts):
    prompt = prompts[0]
    for params in (dict(stop=["lazy dog"]), dict(max_tokens=9), dict(stop_token_ids=[engine.tokenizer.encode(" river")[0]])):
        plain = engine.generate(prompt, greedy(**{"max_tokens": MAX_TOKENS, **params}))
        spec = engine.generate(prompt, greedy(**{"max_tokens": MAX_TOKENS, **params}, speculative="ngram"))
        assert (spec.text, spec.token_ids, spec.finish_reason, spec.matched) == \
            (plain.text, plain.token_ids, plain.finish_reason, plain.matched)
    assert spec.spec_drafted > 0
    assert_pool_whole(engine)


def test_constrained_request_with_speculation_stays_valid(engine):
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                  "required": ["name", "city"]},
        "minItems": 3, "maxItems": 3,
    }
    prompt = chat(engine.tokenizer, COPY[1] + " Answer with a JSON array.")
    plain = engine.generate(prompt, greedy(64, json_schema=schema, jump_forward=None))
    spec = engine.generate(prompt, greedy(64, json_schema=schema, jump_forward=None, speculative="ngram"))
    assert_same_greedy(plain, spec)
    assert spec.spec_drafted > 0 and spec.forced_tokens == 0
    assert spec.finish_reason == "stop" and spec.matched == "grammar"
    jsonschema.validate(json.loads(spec.text), schema)
    assert_pool_whole(engine)


def test_sampling_with_speculation_finishes_cleanly(engine, prompts):
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=3, speculative="ngram")
    a = engine.generate(prompts[0], params)
    b = engine.generate(prompts[0], params)
    assert a.token_ids == b.token_ids  # a seed fixes drafts, acceptances and resamples
    assert a.spec_drafted > 0 and a.completion_tokens > 0
    assert_pool_whole(engine)


def test_speculation_turns_off_when_the_batch_is_large(loaded_model, prompts):
    # With a token cost of 0.4 (and no switch cost), 3 sampling rows set the bar at
    # 0.4 * 3 / (1 + 0.4 * 2) = 0.67, above the prior acceptance estimate (0.5); 1 row at 0.4.
    eng = Engine(model=loaded_model, max_total_tokens=2048, speculative="ngram", speculative_cost=(0.0, 0.4))
    try:
        res = eng.generate_batch(prompts[:3], SamplingParams(max_tokens=8, ignore_eos=True))
        assert all(r.spec_drafted == 0 for r in res)
        alone = eng.generate(prompts[0], SamplingParams(max_tokens=16))
        assert alone.spec_drafted > 0
        assert_pool_whole(eng)
    finally:
        eng.shutdown()


def test_speculative_options_are_checked(loaded_model):
    with pytest.raises(InvalidRequest, match="speculative"):
        Engine(model=loaded_model, max_total_tokens=64, speculative="medusa")
    with pytest.raises(InvalidRequest, match="draft_model"):
        Engine(model=loaded_model, max_total_tokens=64, speculative="draft")
    with pytest.raises(InvalidRequest, match="num_draft_tokens"):
        Engine(model=loaded_model, max_total_tokens=64, num_draft_tokens=0)
    with pytest.raises(InvalidRequest, match="speculative_cost"):
        Engine(model=loaded_model, max_total_tokens=64, speculative_cost=(0.3, -1))
    eng = Engine(model=loaded_model, max_total_tokens=64)
    try:
        with pytest.raises(InvalidRequest, match="draft_model"):
            eng.submit("hi", SamplingParams(max_tokens=2, speculative="draft"))
    finally:
        eng.shutdown()
