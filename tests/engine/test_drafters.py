"""Drafter unit tests (sgrt/engine/drafters.py): n-gram lookup, and a (tiny, random) draft model
whose proposals equal its own greedy decoding, whose KV is reused across calls and released,
and which drafts nothing when its KV pool is too small."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgrt.engine.drafters import DraftModelDrafter, NgramIndex, _DraftSeq
from sgrt.engine.kv_pool import KVPool
from sgrt.engine.model_runner import ModelRunner
from sgrt.engine.request import Req
from sgrt.engine.sampling_params import SamplingParams
from sgrt.engine.scheduler import Row

VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    from sgrt.models import ModelConfig
    from sgrt.models.llama import LlamaForCausalLM

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.5, generator=gen)
    return SimpleNamespace(model=model, config=cfg)


def greedy_reference(tiny, ids: list[int], k: int) -> list[int]:
    """``k`` greedy tokens, each from a fresh full forward over everything before it."""
    out = list(ids)
    for _ in range(k):
        pool = KVPool(len(out), 2, 2, 8, torch.float32, "cpu")
        seq = _DraftSeq(fill_ids=list(out), slots=pool.alloc(len(out)))
        logits = ModelRunner(tiny.model, pool).forward([Row(seq, 0, len(out))], [[len(out) - 1]])[0]
        out.append(int(torch.argmax(logits[0])))
    return out[len(ids):]


def test_ngram_index_prefers_the_longest_suffix_and_the_latest_occurrence():
    idx = NgramIndex()
    ids = [1, 2, 9, 5, 2, 8, 1, 2]
    # "1 2" occurred at 0..1 (followed by 9); "2" alone last occurred at 4 (followed by 8):
    # the longer match wins.
    assert idx.propose(ids, 2) == ([9, 5], 2)
    assert NgramIndex(max_n=1).propose(ids, 2) == ([8, 1], 1)
    assert idx.propose(ids + [9], 3) == ([5, 2, 8], 3)  # "1 2 9" now, indexed incrementally


def test_draft_model_proposes_its_own_greedy_tokens_and_reuses_its_kv(tiny):
    drafter = DraftModelDrafter(tiny, num_slots=64, target_vocab_size=VOCAB)
    r = Req("r", [5, 17, 3, 44], SamplingParams())
    ((tokens, probs),) = drafter.propose([r], [3])
    assert tokens == greedy_reference(tiny, r.fill_ids, 3) and probs is None
    # KV of the 4 prompt tokens and the first 2 drafts (the last draft is never fed).
    assert drafter.num_held() == 6 and drafter.pool.num_free == 58
    # The target accepted the first draft and chose another token: the draft KV of the common
    # prefix (5 tokens) is kept, the rest recomputed.
    r.output_ids = [tokens[0], (tokens[1] + 1) % VOCAB]
    ((again, _),) = drafter.propose([r], [2])
    assert again == greedy_reference(tiny, r.fill_ids, 2)
    assert drafter.num_held() == len(r.fill_ids) + 1
    drafter.release("r")
    assert drafter.num_held() == 0 and drafter.pool.num_free == 64


def test_draft_model_batches_requests_of_different_lengths(tiny):
    drafter = DraftModelDrafter(tiny, num_slots=64, target_vocab_size=VOCAB)
    a, b = Req("a", [1, 2, 3, 4, 5, 6], SamplingParams()), Req("b", [7, 8], SamplingParams())
    out = drafter.propose([a, b], [1, 3])
    assert [t for t, _ in out] == [greedy_reference(tiny, a.fill_ids, 1), greedy_reference(tiny, b.fill_ids, 3)]


def test_sampled_drafts_carry_their_distributions(tiny):
    drafter = DraftModelDrafter(tiny, num_slots=64, target_vocab_size=VOCAB)
    r = Req("r", [5, 6, 7], SamplingParams(temperature=1.0, top_k=5))
    r.generator = torch.Generator().manual_seed(1)
    ((tokens, probs),) = drafter.propose([r], [2])
    assert len(tokens) == 2 and probs.shape == (2, VOCAB)
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    assert all(int((p > 0).sum()) <= 5 and float(p[t]) > 0 for p, t in zip(probs, tokens))


def test_a_request_that_does_not_fit_the_draft_pool_gets_no_draft(tiny):
    drafter = DraftModelDrafter(tiny, num_slots=4, target_vocab_size=VOCAB)
    r = Req("r", [1, 2, 3, 4, 5], SamplingParams())
    assert drafter.propose([r], [2]) == [([], None)]
    assert drafter.pool.num_free == 4
