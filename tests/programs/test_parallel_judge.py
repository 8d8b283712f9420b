"""programs/parallel_judge.py: N forked candidates over one cached prefix, and a select among them."""
from __future__ import annotations

import pytest

from programs.parallel_judge import parallel_judge


def test_candidates_share_the_prefix_and_the_judge_picks_one(runtime):
    runtime.flush_cache()
    st = parallel_judge.run(question="Why do leaves change colour in autumn?", n=3, max_tokens=10)
    candidates = st["candidate"]
    assert isinstance(candidates, list) and len(candidates) == 3
    assert all(isinstance(c, str) and c for c in candidates)
    assert st["best"] in ("1", "2", "3")
    assert st["answer"] == candidates[int(st["best"]) - 1]
    # The prompt was committed to the cache once before the branches ran; each branch prefilled
    # only its own tokens (the assistant header).
    committed = st.executor.fork_commit_meta["prompt_tokens"]
    metas = st.get_meta_info("candidate")
    assert len(metas) == 3
    for meta in metas:
        assert meta["cached_tokens"] >= committed
        assert meta["prompt_tokens"] - meta["cached_tokens"] <= 8
        assert 0 < meta["completion_tokens"] <= 10
    # Branch i samples with seed i: the same run again gives the same candidates.
    again = parallel_judge.run(question="Why do leaves change colour in autumn?", n=3, max_tokens=10)
    assert again["candidate"] == candidates
    # The judge scored each number on top of the cached conversation.
    judge = st.get_meta_info("best")
    assert len(judge["normalized_prompt_logprobs"]) == 3
    assert all(c >= p - 2 for c, p in zip(judge["cached_tokens"], judge["prompt_tokens"]))
    assert st.text().count("Answer 1: ") == 1


def test_n_out_of_range(runtime):
    for n in (1, 10):
        with pytest.raises(ValueError, match="n must be"):
            parallel_judge.run(question="q", n=n)
