"""Engine fixtures: one float32 engine on the default model per test module."""
from __future__ import annotations

import pytest

from sgrt.engine import Engine, Result


@pytest.fixture(scope="module")
def engine(loaded_model):
    eng = Engine(model=loaded_model, max_total_tokens=8192)
    yield eng
    eng.shutdown()


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def assert_same_greedy(a: Result, b: Result, tol: float = 1e-3) -> None:
    """DESIGN.md invariant: token-identical, or at the first divergence the two tokens'
    log-probabilities (from ``a``'s top logprobs) are within ``tol``."""
    if a.token_ids == b.token_ids:
        return
    n = min(len(a.token_ids), len(b.token_ids))
    i = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), n)
    assert i < n, f"one output is a prefix of the other: {a.text!r} vs {b.text!r}"
    assert a.output_top_logprobs is not None, "need top logprobs to judge a near-tie"
    tops = dict(a.output_top_logprobs[i])
    tok_a, tok_b = a.token_ids[i], b.token_ids[i]
    assert tok_b in tops, f"diverged at {i}: {tok_b} is not in the reference's top logprobs"
    assert abs(tops[tok_a] - tops[tok_b]) <= tol, f"diverged at {i} without a near-tie"
