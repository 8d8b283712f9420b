"""Verify a draft against the target model's logits: greedy prefix match or rejection sampling.

A verify row feeds the request's last token and ``k`` draft tokens; its ``k + 1`` logits rows
score position 0 (what follows the last token), 1 (what follows draft 0), ... k (the "bonus"
position after the whole draft). :func:`verify` walks them in order:

* greedy (``temperature == 0``): draft ``j`` is accepted when it equals the target's argmax at
  ``j``; at the first mismatch (or after all ``k``) the target's argmax is taken, so the output
  is the output of plain greedy decoding;
* sampling: rejection sampling (Leviathan et al., arXiv:2211.17192; Chen et al.,
  arXiv:2302.01318): accept draft ``d`` with probability ``min(1, p(d) / q(d))``, on rejection
  draw from ``normalise(max(0, p - q))``; after ``k`` acceptances draw the bonus from ``p``.
  With a point-mass draft (n-gram lookup, jump-forward) ``q(d) = 1``: accept with ``p(d)``,
  resample from ``p`` with ``d`` removed. The output distribution is exactly ``p``.

``p`` is the distribution the plain sampler would draw from at that position: grammar mask,
penalties and the ``min_tokens`` ban (:func:`sgrt.engine.sampler.process_row`, seeing the draft
tokens before the position as output), then temperature / top-k / min-p / top-p
(:func:`sgrt.engine.sampler.sampling_probs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sgrt.engine.sampler import greedy_token, needs_processing, process_row, sampling_probs, top_logprobs


@dataclass
class Draft:
    """Tokens proposed for one request, checked against its grammar.

    Attributes:
        tokens: the ``k`` draft token ids.
        probs: ``[k, V]`` float32 draft distributions ``q`` the tokens were sampled from, or
            None for a point mass (n-gram lookup, jump-forward, greedy draft model).
        num_forced: how many leading tokens came from jump-forward (forced by the grammar).
        masks: ``[k + 1, ceil(V / 32)]`` int32 grammar bitmask of each verified position, or
            None for an unconstrained request.
        terminal: the grammar terminates after the last draft token, so there is no bonus
            position to sample.
        source: which acceptance estimate the outcome updates (``sgrt.engine.speculative``).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    num_forced: int = 0
    masks: torch.Tensor | None = None
    terminal: bool = False
    source: int = 0


@dataclass
class VerifyOutput:
    """What verification keeps: ``tokens`` = the accepted drafts then (unless the draft was
    terminal and fully accepted) one token from the target; logprobs as the sampler reports
    them (raw log-softmax), filled only when the request asked for them."""

    tokens: list[int]
    num_accepted: int
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


class _DraftView:
    """What :func:`process_row` reads of a request, as if ``extra`` had been generated."""

    def __init__(self, req: Any, extra: list[int]):
        self.params = req.params
        self.output_ids = req.output_ids + extra
        self.fill_ids = req.prompt_ids + self.output_ids


def verify(logits: torch.Tensor, req: Any, draft: Draft, eos_ids: set[int]) -> VerifyOutput:
    """Verify ``draft`` for ``req`` against ``logits`` ``[k + 1, V]`` float32 (raw).

    ``req`` needs ``params``, ``prompt_ids``, ``output_ids`` and ``generator`` (a
    :class:`sgrt.engine.request.Req`). The request is not modified.
    """
    params = req.params
    k = len(draft.tokens)
    greedy = params.temperature == 0.0
    processed = logits.clone()
    if draft.masks is not None:
        from sgrt.constrained import apply_token_bitmask_

        apply_token_bitmask_(processed, draft.masks[: k + 1])
    plain = not needs_processing(req)
    argmax = [greedy_token(row) for row in processed] if greedy and plain else None
    tokens: list[int] = []
    accepted = 0
    for j in range(k + 1):
        if j == k and draft.terminal:
            break
        d = draft.tokens[j] if j < k else None
        if argmax is not None:
            t = argmax[j]
        else:
            row = processed[j]
            if not plain:
                process_row(row, _DraftView(req, draft.tokens[:j]), eos_ids)
            t = greedy_token(row) if greedy else None
        if greedy:
            tokens.append(t)
            if t == d:
                accepted += 1
                continue
            break
        p = _normalised(sampling_probs(processed[j], params))
        if d is None:
            tokens.append(_draw(p, req.generator))
            break
        q = None if draft.probs is None else draft.probs[j]
        if _accepts(p, q, d, req.generator):
            tokens.append(d)
            accepted += 1
            continue
        tokens.append(_draw(_residual(p, q, d), req.generator))
        break
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    if params.return_logprob and tokens:
        raw = torch.log_softmax(logits[: len(tokens)], dim=-1)
        for j, t in enumerate(tokens):
            logprobs.append(float(raw[j, t]))
            tops.append(top_logprobs(raw[j], params.top_logprobs_num))
    return VerifyOutput(tokens, accepted, logprobs, tops)


def _normalised(p: torch.Tensor) -> torch.Tensor:
    s = p.sum()
    if not torch.isfinite(s) or s <= 0:  # everything masked: keep the plain sampler's failure mode
        return torch.nn.functional.one_hot(p.nan_to_num(-1.0).argmax(), p.shape[-1]).to(p.dtype)
    return p / s


def _uniform(p: torch.Tensor, generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, device=p.device))


def _accepts(p: torch.Tensor, q: torch.Tensor | None, d: int, generator: torch.Generator | None) -> bool:
    """Accept draft ``d`` with probability ``min(1, p(d) / q(d))`` (``q`` None: a point mass)."""
    pd = float(p[d])
    if pd <= 0.0:
        return False
    qd = 1.0 if q is None else float(q[d])
    if qd <= pd:
        return True
    return _uniform(p, generator) < pd / qd


def _residual(p: torch.Tensor, q: torch.Tensor | None, d: int) -> torch.Tensor:
    """``normalise(max(0, p - q))``; for a point mass at ``d``, ``p`` without ``d``."""
    if q is None:
        r = p.clone()
        r[d] = 0.0
    else:
        r = torch.clamp(p - q[: p.shape[-1]], min=0.0)
    if float(r.sum()) <= 0.0:  # p == q (up to rounding): any draw from p is exact
        return p
    return r / r.sum()


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def token_allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether ``token`` is allowed in row ``row`` of an int32 token bitmask (bit ``t % 32`` of
    word ``t // 32``, set = allowed; the layout of llguidance and XGrammar)."""
    word = int(bitmask[row, token >> 5])
    return (word >> (token & 31)) & 1 == 1


def walk_grammar(grammar: Any, tokens: list[int], vocab_size: int) -> Draft:
    """Cut ``tokens`` at the first one ``grammar`` forbids (or right after the one that
    terminates it) and record the grammar mask of every position to verify.

    The grammar is advanced through the kept tokens and rolled back, so it ends where it
    started (``rollback`` must be exact).
    """
    from sgrt.constrained import allocate_token_bitmask

    masks = allocate_token_bitmask(len(tokens) + 1, vocab_size)
    n = 0
    terminal = False
    try:
        for j, t in enumerate(tokens):
            grammar.fill_vocab_mask(masks, j)
            if not token_allowed(masks, j, t) or not grammar.accept_token(t):
                break
            n += 1
            if grammar.is_terminated():
                terminal = True
                break
        if not terminal:
            grammar.fill_vocab_mask(masks, n)
    finally:
        if n:
            grammar.rollback(n)
    return Draft(tokens=list(tokens[:n]), masks=masks[: n + 1], terminal=terminal)
