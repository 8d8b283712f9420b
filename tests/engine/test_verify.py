"""Verification unit tests (sgrt/engine/verify.py): grammar walks that cut drafts and restore
the grammar, masks and penalties applied per verified position, the min_tokens ban counting the
draft tokens before a position, and raw log-probabilities of the kept tokens. (Greedy prefix
acceptance and the rejection-sampling distribution: tests/engine/test_speculative.py.)"""
from __future__ import annotations

import math

import torch

from sgrt.constrained import allocate_token_bitmask
from sgrt.engine.request import Req
from sgrt.engine.sampling_params import SamplingParams
from sgrt.engine.verify import Draft, token_allowed, verify, walk_grammar


class SequenceGrammar:
    """Accepts exactly ``seq`` (terminating after it); allows only the next token of it."""

    def __init__(self, seq: list[int]):
        self.seq = seq
        self.pos = 0
        self.rolled_back = 0

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        mask[row] = 0
        if self.pos < len(self.seq):
            t = self.seq[self.pos]
            mask[row, t >> 5] = 1 << (t & 31)

    def accept_token(self, t: int) -> bool:
        if self.pos < len(self.seq) and self.seq[self.pos] == t:
            self.pos += 1
            return True
        return False

    def rollback(self, n: int) -> None:
        self.pos -= n
        self.rolled_back += n

    def is_terminated(self) -> bool:
        return self.pos == len(self.seq)


def test_token_allowed_reads_bit_t_mod_32_of_word_t_div_32():
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[1, 2] = 1 << 5  # token 69
    assert token_allowed(mask, 1, 69)
    assert not token_allowed(mask, 1, 68) and not token_allowed(mask, 0, 69)


def test_walk_grammar_cuts_at_the_first_forbidden_token_and_restores_the_grammar():
    g = SequenceGrammar([3, 40, 5, 6])
    walked = walk_grammar(g, [3, 40, 9, 6], vocab_size=64)
    assert walked.tokens == [3, 40] and not walked.terminal
    assert g.pos == 0 and g.rolled_back == 2
    assert walked.masks.shape == (3, 2)  # one mask per verified position: 2 drafts + the next
    assert token_allowed(walked.masks, 0, 3) and token_allowed(walked.masks, 1, 40)
    assert token_allowed(walked.masks, 2, 5) and not token_allowed(walked.masks, 2, 9)


def test_walk_grammar_stops_after_the_terminating_token():
    g = SequenceGrammar([3, 4])
    walked = walk_grammar(g, [3, 4, 7, 7], vocab_size=64)
    assert walked.tokens == [3, 4] and walked.terminal and g.pos == 0


def test_greedy_verify_takes_the_masked_argmax_and_raw_logprobs():
    v = 64
    logits = torch.zeros(3, v)
    logits[:, 10] = 9.0  # the model's favourite everywhere; the grammar forbids it
    logits[0, 3] = logits[1, 4] = logits[2, 5] = 1.0
    g = SequenceGrammar([3, 4, 5])
    walked = walk_grammar(g, [3, 4], v)
    draft = Draft(tokens=walked.tokens, masks=walked.masks, terminal=walked.terminal)
    r = Req("r", [1], SamplingParams(return_logprob=True, top_logprobs_num=1))
    out = verify(logits, r, draft, eos_ids=set())
    assert out.tokens == [3, 4, 5] and out.num_accepted == 2
    raw = torch.log_softmax(logits, -1)
    assert all(math.isclose(out.logprobs[j], float(raw[j, t]), rel_tol=1e-6) for j, t in enumerate(out.tokens))
    assert out.top_logprobs[0][0][0] == 10  # reported from the raw distribution
    assert r.output_ids == [], "verify must not modify the request"


def test_min_tokens_ban_counts_the_draft_tokens_before_each_position():
    v, eos = 8, 7
    logits = torch.zeros(3, v)
    logits[:, eos] = 5.0  # EOS is the argmax everywhere
    logits[:, 2] = 4.0
    r = Req("r", [1], SamplingParams(min_tokens=2))
    out = verify(logits, r, Draft(tokens=[2, 2]), eos_ids={eos})
    # Positions 0 and 1 have 0 and 1 output tokens before them: EOS banned, 2 accepted; at
    # position 2 two tokens are out, so EOS is allowed again and taken.
    assert out.tokens == [2, 2, eos] and out.num_accepted == 2


def test_repetition_penalty_sees_the_draft_tokens_before_each_position():
    v = 8
    logits = torch.zeros(2, v)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    r = Req("r", [1], SamplingParams(repetition_penalty=2.0))
    out = verify(logits, r, Draft(tokens=[3]), eos_ids=set())
    # Position 0: 3 wins (2.0 > 1.5). Position 1: 3 was just generated, 2.0 / 2 < 1.5.
    assert out.tokens == [3, 4] and out.num_accepted == 1


def test_allocated_bitmask_allows_everything_until_a_grammar_fills_it():
    mask = allocate_token_bitmask(1, 40)
    assert all(token_allowed(mask, 0, t) for t in range(40))
