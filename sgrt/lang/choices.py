"""How ``select`` turns the options' token log-probabilities into a decision.

A method is called as SGLang's ``RuntimeEndpoint.select`` calls one, with keyword arguments
only (``sglang.lang.choices``): ``choices``; ``normalized_prompt_logprobs`` (per option, the mean
log-probability of its tokens after the prompt); ``input_token_logprobs`` (per option, its
tokens' ``(logprob, token_id, text)`` entries); ``output_token_logprobs`` (per option ``[]``:
scoring generates nothing); ``unconditional_token_logprobs`` (per option, the same tokens'
entries scored without the prompt, the first log-probability ``None``; given only to a method
whose ``requires_unconditional_logprobs`` is true, else ``None``). It returns a
:class:`ChoicesDecision`, whose ``meta_info`` goes into ``s.get_meta_info(name)``.

Three methods, as in SGLang:

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

#: One token's entry: ``(logprob, token_id, text)`` (``logprob`` ``None`` where it has no context).
Entry = Sequence[Any]


@dataclass
class ChoicesDecision:
    """The chosen option and what the method computed (goes into ``s.get_meta_info(name)``;
    ``None`` is taken as no extra information)."""

    decision: str
    meta_info: dict[str, Any] | None = field(default_factory=dict)


class ChoicesSamplingMethod(ABC):
    """A rule that picks one option of a ``select`` (SGLang's call signature, see the module
    docstring)."""

    #: Whether :meth:`__call__` needs ``unconditional_token_logprobs`` (a subclass may override
    #: it with a property, as SGLang's methods do).
    requires_unconditional_logprobs: bool = False

    @abstractmethod
    def __call__(self, *, choices: Sequence[str],
                 normalized_prompt_logprobs: Sequence[float],
                 input_token_logprobs: Sequence[Sequence[Entry]],
                 output_token_logprobs: Sequence[Sequence[Entry]],
                 unconditional_token_logprobs: Sequence[Sequence[Entry]] | None = None,
                 ) -> ChoicesDecision:
        """Pick one of ``choices``.

        Args:
            choices: the options, in order.
            normalized_prompt_logprobs: per option, the mean log-probability (natural log) of
                its tokens after the prompt.
            input_token_logprobs: per option, ``(logprob, token_id, text)`` of each of its
                tokens after the prompt; every option has at least one token.
            output_token_logprobs: per option, ``[]``.
            unconditional_token_logprobs: per option, the entries of the same tokens scored
                without the prompt (first log-probability ``None``); only for methods that
                require them.
        """


def _logprobs(entries: Sequence[Entry]) -> list[float | None]:
    return [e[0] for e in entries]


def mean_logprob(values: Sequence[float | None]) -> float:
    """Mean of the values that are not ``None``; ``-inf`` for none (such an option never wins)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else -math.inf


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": list(normalized_prompt_logprobs),
        "input_token_logprobs": input_token_logprobs,
        "output_token_logprobs": output_token_logprobs,
    }


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The option with the highest mean token log-probability (ties: the first)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], _base_meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the options tied at the best log-probability of each position.

    Options shorter than the longest are padded with their own mean log-probability, so a short
    option competes at later positions with its average. The scan stops when one option is
    left; if several survive every position, the first of them wins. ``greedy_logprob_matrix``
    (options x positions) goes into the meta info.
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        rows = [_logprobs(entries) for entries in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [[-math.inf if v is None else v for v in r] + [mean_logprob(r)] * (width - len(r))
                  for r in rows]
        alive = list(range(len(choices)))
        for col in range(width):
            best = max(matrix[i][col] for i in alive)
            alive = [i for i in alive if matrix[i][col] == best]
            if len(alive) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[alive[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The option with the highest mean of ``logp(tok | prompt) - logp(tok | nothing)``.

    An unconditional log-probability of ``None`` (the option's first token has no context, and
    a backend that scores options approximately may pad) counts as 0. The meta info adds
    ``unconditional_token_logprobs`` and ``normalized_unconditional_prompt_logprobs`` (the
    per-option scores).

    Raises:
        ValueError: no ``unconditional_token_logprobs``, or an option whose two lists differ in
            length.
    """

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        if unconditional_token_logprobs is None:
            raise ValueError(
                "unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("an option's conditional and unconditional token log-probabilities "
                                 f"differ in length ({len(cond)} and {len(uncond)})")
            scores.append(mean_logprob([(c or 0.0) - (u or 0.0)
                                 for c, u in zip(_logprobs(cond), _logprobs(uncond))]))
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
