"""The three select methods on hand-made log-probabilities (no model)."""
from __future__ import annotations

import math

import pytest

from sgrt.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

CHOICES = ["organ", "organism", "antidisestablishmentarianism"]
# "organ" is 1 token, "organism" 2 (organ + ism), the long word 4.
COND = [
    [-1.0],                      # mean -1.0
    [-1.0, -0.5],                # mean -0.75
    [-2.0, -0.1, -0.1, -0.1],    # mean -0.575: best on average
]
# Without context: "organ" is common anyway, the long word is rare in general.
UNCOND = [
    [None],
    [None, -4.0],
    [None, -0.2, -0.2, -0.2],
]


def test_token_length_normalized_picks_best_mean():
    d = token_length_normalized(choices=CHOICES, token_logprobs=COND)
    assert d.decision == "antidisestablishmentarianism"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -0.75, -0.575])


def test_greedy_token_selection_scans_columns():
    # Column 0: organ -1.0, organism -1.0 (tied), long -2.0 -> keep organ and organism.
    # Column 1: organ is padded with its mean -1.0, organism -0.5 -> organism.
    d = greedy_token_selection(choices=CHOICES, token_logprobs=COND)
    assert d.decision == "organism"
    assert d.meta_info["greedy_logprob_matrix"][0] == [-1.0, -1.0, -1.0, -1.0]


def test_greedy_token_selection_first_column_decides():
    d = greedy_token_selection(choices=["a", "b"], token_logprobs=[[-0.1, -9.0], [-0.2, -0.1]])
    assert d.decision == "a"


def test_greedy_ties_everywhere_keep_first():
    d = greedy_token_selection(choices=["x", "y"], token_logprobs=[[-1.0], [-1.0]])
    assert d.decision == "x"


def test_unconditional_likelihood_normalized():
    # organ: (-1 - 0) / 1 = -1.0 ; organism: (-1 + (-0.5 + 4.0)) / 2 = 1.25 ;
    # long: (-2 + 3 * 0.1) / 4 = -0.425
    d = unconditional_likelihood_normalized(choices=CHOICES, token_logprobs=COND,
                                            unconditional_token_logprobs=UNCOND)
    assert d.decision == "organism"
    assert d.meta_info["unconditional_normalized_logprobs"] == pytest.approx([-1.0, 1.25, -0.425])
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs


def test_each_method_can_win_with_its_own_data():
    # The SGLang test's shape: each method prefers a different option.
    cond = [[-0.2], [-0.2, -0.9], [-0.5, -0.01, -0.01, -0.01]]
    assert greedy_token_selection(choices=CHOICES, token_logprobs=cond).decision == "organ"
    assert token_length_normalized(choices=CHOICES, token_logprobs=cond).decision == (
        "antidisestablishmentarianism")
    uncond = [[None], [None, -5.0], [None, -0.01, -0.01, -0.01]]
    assert unconditional_likelihood_normalized(
        choices=CHOICES, token_logprobs=cond, unconditional_token_logprobs=uncond
    ).decision == "organism"


def test_unconditional_requires_data():
    with pytest.raises(ValueError):
        unconditional_likelihood_normalized(choices=["a"], token_logprobs=[[-1.0]])


def test_empty_token_list_never_wins():
    d = token_length_normalized(choices=["a", "b"], token_logprobs=[[], [-3.0]])
    assert d.decision == "b"
    assert d.meta_info["normalized_prompt_logprobs"][0] == -math.inf
