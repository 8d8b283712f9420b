"""How ``select`` turns the options' token log-probabilities into a decision.

A method receives, for each option, the log-probabilities of its own tokens after the prompt
(and, if it asks for them, the same tokens scored without the prompt) and returns a
:class:`ChoicesDecision`. Three methods, as in SGLang:

- :data:`token_length_normalized` (default): highest mean token log-probability.
- :data:`greedy_token_selection`: compare the options token by token, keeping those tied at the
  best log-probability of each position, as greedy decoding restricted to the options would.
- :data:`unconditional_likelihood_normalized`: highest mean of ``logp(token | prompt) -
  logp(token | nothing)``, which discounts options that are likely anywhere.

Write your own by subclassing :class:`ChoicesSamplingMethod`.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    """The chosen option and what the method computed (goes into ``s.get_meta_info(name)``)."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesSamplingMethod(ABC):
    """A rule that picks one option of a ``select``."""

    #: Whether :meth:`__call__` needs ``unconditional_token_logprobs``.
    requires_unconditional_logprobs: bool = False

    @abstractmethod
    def __call__(self, *, choices: Sequence[str],
                 token_logprobs: Sequence[Sequence[float]],
                 unconditional_token_logprobs: Sequence[Sequence[float | None]] | None = None,
                 ) -> ChoicesDecision:
        """Pick one of ``choices``.

        Args:
            choices: the options, in order.
            token_logprobs: per option, the log-probabilities (natural log) of its tokens after
                the prompt; every option has at least one token.
            unconditional_token_logprobs: per option, the same tokens scored without the prompt
                (first entry ``None``); given only to methods that require it.
        """


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The option with the highest mean token log-probability (ties: the first)."""

    def __call__(self, *, choices, token_logprobs, unconditional_token_logprobs=None):
        scores = [_mean(lp) for lp in token_logprobs]
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {"normalized_prompt_logprobs": scores})


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the options tied at the best log-probability of each position.

    Options shorter than the longest are padded with their own mean log-probability, so a short
    option competes at later positions with its average. The scan stops when one option is
    left; if several survive every position, the first of them wins.
    """

    def __call__(self, *, choices, token_logprobs, unconditional_token_logprobs=None):
        width = max(len(lp) for lp in token_logprobs)
        matrix = [list(lp) + [_mean(lp)] * (width - len(lp)) for lp in token_logprobs]
        alive = list(range(len(choices)))
        for col in range(width):
            best = max(matrix[i][col] for i in alive)
            alive = [i for i in alive if matrix[i][col] == best]
            if len(alive) == 1:
                break
        scores = [_mean(lp) for lp in token_logprobs]
        return ChoicesDecision(choices[alive[0]], {
            "normalized_prompt_logprobs": scores,
            "greedy_logprob_matrix": matrix,
        })


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The option with the highest mean of ``logp(tok | prompt) - logp(tok | nothing)``.

    The unconditional log-probability of an option's first token is undefined (no context) and
    counts as 0.
    """

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, token_logprobs, unconditional_token_logprobs=None):
        if unconditional_token_logprobs is None:
            raise ValueError(
                "unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(token_logprobs, unconditional_token_logprobs):
            diffs = [c - (u or 0.0) for c, u in zip(cond, uncond)]
            scores.append(_mean(diffs))
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": [_mean(lp) for lp in token_logprobs],
            "unconditional_normalized_logprobs": scores,
        })


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
