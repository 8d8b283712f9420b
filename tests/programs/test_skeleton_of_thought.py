"""programs/skeleton_of_thought.py: an outline with exactly N points, expanded in N forks."""
from __future__ import annotations

import re

import pytest

from programs.skeleton_of_thought import outline_regex, parse_outline, skeleton_of_thought


def test_outline_then_parallel_expansions(runtime):
    runtime.flush_cache()
    st = skeleton_of_thought.run(question="How can I sleep better?", num_points=2, point_chars=30,
                                 expansion_tokens=12)
    skeleton = st["skeleton"]
    meta = st.get_meta_info("skeleton")
    if meta["finish_reason"]["type"] == "stop":  # the regex completed: exactly two numbered points
        assert re.fullmatch(outline_regex(2, 30), skeleton)
        assert len(st["points"]) == 2
    points = st["points"]
    assert points == parse_outline(skeleton) and 1 <= len(points) <= 2
    expansions = st["expansion"]
    assert isinstance(expansions, list) and len(expansions) == len(points)
    assert all(isinstance(e, str) for e in expansions)
    # Each branch prefilled only its own message: the outline conversation was committed once.
    committed = st.executor.fork_commit_meta["prompt_tokens"]
    for i, m in enumerate(st.get_meta_info("expansion")):
        assert m["cached_tokens"] >= committed
        assert 0 < m["completion_tokens"] <= 12
    answer = st["answer"]
    assert all(f"{i + 1}. {p}\n" in answer for i, p in enumerate(points))
    # join() gathers variables; the parent's text ends with the outline turn.
    assert st.text().endswith(skeleton + "<|im_end|>\n")


def test_outline_regex_and_parse():
    rx = outline_regex(3, 10)
    assert re.fullmatch(rx, "1. Eat well\n2. Walk\n3. Sleep")
    assert not re.fullmatch(rx, "1. Eat well\n2. Walk")
    assert not re.fullmatch(rx, "1. This point is far too long\n2. Walk\n3. Sleep")
    assert parse_outline("1. Eat well\n2. Walk\n3. Sleep") == ["Eat well", "Walk", "Sleep"]


def test_num_points_out_of_range(runtime):
    with pytest.raises(ValueError, match="num_points"):
        skeleton_of_thought.run(question="q", num_points=0)
