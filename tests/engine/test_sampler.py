"""Sampler unit tests (sgrt/engine/sampler.py): penalties as defined by CTRL and OpenAI, the
min_tokens ban, temperature / top-k / min-p / top-p, grammar masks, seeds, and log-probabilities
of the raw distribution."""
from __future__ import annotations

import math

import torch

from sgrt.constrained import allocate_token_bitmask
from sgrt.engine.request import Req
from sgrt.engine.sampler import apply_penalties, greedy_token, greedy_tokens, process_row, sample, sampling_probs, top_logprobs
from sgrt.engine.sampling_params import SamplingParams


def req(prompt=(1, 2), output=(), **params) -> Req:
    r = Req("r", list(prompt), SamplingParams(**params))
    r.output_ids = list(output)
    return r


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0])
    apply_penalties(row, req(prompt=(0,), output=(1,), repetition_penalty=2.0))
    assert row.tolist() == [1.0, -4.0, 2.0, -2.0, 1.0]  # tokens 0 (prompt) and 1 (output) seen


def test_frequency_and_presence_penalties_count_output_tokens_only():
    row = torch.zeros(5)
    apply_penalties(row, req(prompt=(4,), output=(1, 1, 2), frequency_penalty=0.5, presence_penalty=0.25))
    assert row.tolist() == [0.0, -1.25, -0.75, 0.0, 0.0]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    row = torch.zeros(6)
    process_row(row, req(output=(3,), min_tokens=2, stop_token_ids=[4]), eos_ids={5})
    assert row.tolist() == [0.0, 0.0, 0.0, 0.0, -math.inf, -math.inf]
    row = torch.zeros(6)
    process_row(row, req(output=(3, 3), min_tokens=2, stop_token_ids=[4]), eos_ids={5})
    assert row.tolist() == [0.0] * 6


def test_sampling_probs_applies_temperature_then_top_k_min_p_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = sampling_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    p = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.4))  # keep p >= 0.2
    assert torch.allclose(p, torch.tensor([0.5, 0.25, 0.0, 0.0]))
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reach 0.7
    assert torch.allclose(p, torch.tensor([0.5, 0.25, 0.0, 0.0]))
    p = sampling_probs(logits, SamplingParams(temperature=0.5))  # p ** 2, renormalised
    q = torch.tensor([0.25, 0.0625, 0.0225, 0.01])
    assert torch.allclose(p, q / q.sum())


def test_greedy_sample_respects_the_grammar_mask_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    reqs = [req(return_logprob=True, top_logprobs_num=2), req()]
    mask = allocate_token_bitmask(2, 4)
    mask[0, 0] = 0b1101  # row 0: token 1 forbidden
    out = sample(logits, reqs, mask, eos_ids=set())
    assert out.token_ids == [3, 0]
    raw = torch.log_softmax(logits[0], -1)
    # The log-probability is the model's (unmasked), as vLLM and SGLang report it.
    assert math.isclose(out.logprobs[0], float(raw[3]), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [1, 3]
    assert out.logprobs[1] == 0.0 and out.top_logprobs[1] == []  # not asked for


def test_a_seed_makes_sampling_reproducible():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))

    def draw(seed: int) -> list[int]:
        r = req(temperature=1.0)
        r.generator = torch.Generator().manual_seed(seed)
        return [sample(logits, [r], None, set()).token_ids[0] for _ in range(20)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_top_logprobs_are_sorted_pairs():
    row = torch.log_softmax(torch.tensor([1.0, 3.0, 2.0]), -1)
    top = top_logprobs(row, 2)
    assert [t for t, _ in top] == [1, 2] and math.isclose(top[0][1], float(row[1]), rel_tol=1e-6)
    assert top_logprobs(row, 0) == []


def test_greedy_token_is_torch_argmax_on_ties_nan_infinities_and_strided_rows():
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(0)
    rows = [torch.tensor(v) for v in ([1.0, 3.0, 3.0, 2.0], [1.0, nan, 3.0, nan], [-inf, -inf, -inf],
                                      [inf, 1.0, inf], [-0.0, 0.0], [0.5])]
    rows.append(torch.randn(4, 49152, generator=g)[:, 7])  # a strided column
    rows.append(torch.randn(49152, generator=g).round())  # many tied values
    for row in rows:
        assert greedy_token(row) == int(torch.argmax(row)), row
    assert greedy_token(torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64)) == 1  # torch's path


def test_sample_leaves_its_logits_unchanged():
    """Masks and penalties edit a copy: the caller's logits (a view into the forward's) stay raw."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    before = logits.clone()
    bitmask = allocate_token_bitmask(2, 4)
    bitmask[0] = 0b0110  # tokens 1 and 2 only
    out = sample(logits, [req(prompt=(0,), output=(1,), temperature=0.0, repetition_penalty=4.0), req(temperature=0.0)],
                 bitmask, eos_ids={3})
    assert out.token_ids == [2, 3]  # token 1 (seen) penalised to 0.5, below token 2
    assert torch.equal(logits, before)
    out = sample(logits, [req(temperature=0.0, min_tokens=1), req(temperature=0.0)], None, eos_ids={0, 3})
    assert out.token_ids == [1, 3] and torch.equal(logits, before)


def test_greedy_batch_path_picks_each_rows_argmax_and_the_general_path_the_same():
    """Plain greedy rows take one argmax call for the batch (greedy_tokens); the tokens are
    each row's greedy_token, ties, NaN and infinities included, and equal the general path's
    (a row that asks for log-probabilities sends the batch through it)."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 49152, generator=g).round()  # many ties
    logits[1, 5] = nan
    logits[1, 9] = nan
    logits[2] = -inf
    logits[3, 100] = inf
    logits[3, 200] = inf
    logits[4, 7] = 1e9
    expect = [greedy_token(row) for row in logits]
    assert greedy_tokens(logits) == expect == [int(torch.argmax(row)) for row in logits]
    assert greedy_tokens(logits.double()) == expect  # torch's path
    plain = [req(temperature=0.0) for _ in range(6)]
    fast = sample(logits, plain, None, eos_ids={0})
    general = sample(logits, plain[:5] + [req(temperature=0.0, return_logprob=True)], None, eos_ids={0})
    assert fast.token_ids == general.token_ids == expect
    assert fast.logprobs == [0.0] * 6 and fast.top_logprobs == [[]] * 6
    assert sample(logits[:1, :10], [req(temperature=0.0, min_tokens=1)], None, eos_ids={int(logits[0, :10].argmax())}
                  ).token_ids != [int(logits[0, :10].argmax())]  # min_tokens still bans EOS (general path)
