"""The three select methods on hand-made log-probabilities (no model), called with SGLang's
keyword arguments (``sglang.lang.choices``)."""
from __future__ import annotations

import math

import pytest

from sgrt.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
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


def inputs(cond, uncond=None, choices=CHOICES):
    """What the interpreter passes a method: entries ``(logprob, token_id, text)`` per option."""
    def entries(lps, first_id):
        return [(lp, first_id + j, None) for j, lp in enumerate(lps)]

    return {
        "choices": choices,
        "normalized_prompt_logprobs": [sum(x) / len(x) if x else -math.inf for x in cond],
        "input_token_logprobs": [entries(x, 10 * i) for i, x in enumerate(cond)],
        "output_token_logprobs": [[] for _ in cond],
        "unconditional_token_logprobs": (
            None if uncond is None else [entries(x, 10 * i) for i, x in enumerate(uncond)]),
    }


def test_token_length_normalized_picks_best_mean():
    d = token_length_normalized(**inputs(COND))
    assert d.decision == "antidisestablishmentarianism"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -0.75, -0.575])
    assert d.meta_info["input_token_logprobs"][1] == [(-1.0, 10, None), (-0.5, 11, None)]
    assert d.meta_info["output_token_logprobs"] == [[], [], []]


def test_greedy_token_selection_scans_columns():
    # Column 0: organ -1.0, organism -1.0 (tied), long -2.0 -> keep organ and organism.
    # Column 1: organ is padded with its mean -1.0, organism -0.5 -> organism.
    d = greedy_token_selection(**inputs(COND))
    assert d.decision == "organism"
    assert d.meta_info["greedy_logprob_matrix"][0] == [-1.0, -1.0, -1.0, -1.0]
    assert d.meta_info["greedy_logprob_matrix"][1] == [-1.0, -0.5, -0.75, -0.75]


def test_greedy_token_selection_first_column_decides():
    d = greedy_token_selection(**inputs([[-0.1, -9.0], [-0.2, -0.1]], choices=["a", "b"]))
    assert d.decision == "a"


def test_greedy_ties_everywhere_keep_first():
    d = greedy_token_selection(**inputs([[-1.0], [-1.0]], choices=["x", "y"]))
    assert d.decision == "x"


def test_unconditional_likelihood_normalized():
    # organ: (-1 - 0) / 1 = -1.0 ; organism: (-1 + (-0.5 + 4.0)) / 2 = 1.25 ;
    # long: (-2 + 3 * 0.1) / 4 = -0.425
    d = unconditional_likelihood_normalized(**inputs(COND, UNCOND))
    assert d.decision == "organism"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx(
        [-1.0, 1.25, -0.425])
    assert d.meta_info["unconditional_token_logprobs"][1] == [(None, 10, None), (-4.0, 11, None)]
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs


def test_each_method_can_win_with_its_own_data():
    # The SGLang test's shape: each method prefers a different option.
    cond = [[-0.2], [-0.2, -0.9], [-0.5, -0.01, -0.01, -0.01]]
    uncond = [[None], [None, -5.0], [None, -0.01, -0.01, -0.01]]
    assert greedy_token_selection(**inputs(cond)).decision == "organ"
    assert token_length_normalized(**inputs(cond)).decision == "antidisestablishmentarianism"
    assert unconditional_likelihood_normalized(**inputs(cond, uncond)).decision == "organism"


def test_unconditional_requires_data_of_the_same_length():
    with pytest.raises(ValueError):
        unconditional_likelihood_normalized(**inputs([[-1.0]], choices=["a"]))
    with pytest.raises(ValueError, match="differ in length"):
        unconditional_likelihood_normalized(**inputs([[-1.0, -2.0]], [[None]], choices=["a"]))


def test_empty_token_list_never_wins():
    d = token_length_normalized(**inputs([[], [-3.0]], choices=["a", "b"]))
    assert d.decision == "b"
    assert d.meta_info["normalized_prompt_logprobs"][0] == -math.inf


def test_a_method_written_to_sglangs_signature():
    class Shortest(ChoicesSamplingMethod):
        def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                     output_token_logprobs, unconditional_token_logprobs=None):
            best = min(range(len(choices)), key=lambda i: len(input_token_logprobs[i]))
            return ChoicesDecision(choices[best], {"lengths": [len(x) for x in input_token_logprobs]})

    d = Shortest()(**inputs(COND))
    assert d.decision == "organ" and d.meta_info == {"lengths": [1, 2, 4]}
