"""Drafters for speculative decoding: n-gram prompt lookup and a small draft model.

* :class:`NgramIndex` (prompt lookup decoding, Saxena 2023; vLLM's ``ngram`` proposer): find the
  most recent earlier occurrence of the last ``n`` tokens (``n`` = 3, then 2, then 1) in prompt
  + output and propose what followed it. No model, no KV; wins when the output copies spans of
  the input (extraction, editing, summaries with quotes, code).
* :class:`DraftModelDrafter`: a smaller model with the target's tokenizer proposes ``k`` tokens
  autoregressively, in one ragged batch for all drafting requests. It keeps its own KV pool and,
  per request, the KV of every token it has seen, so each step feeds only the tokens accepted
  since the last one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgrt.engine.kv_pool import KVPool
from sgrt.engine.model_runner import ModelRunner
from sgrt.engine.sampler import greedy_token, sampling_probs
from sgrt.engine.scheduler import Row
from sgrt.token_ids import common_prefix_len


class NgramIndex:
    """The last occurrence of every 1..``max_n``-gram of one request's growing token list.

    Incremental: each call indexes only the tokens added since the previous one, so a step
    costs O(new tokens), not O(context). The token list may only grow (prompt + output do).
    """

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._indexed = 0  # n-grams ending before this index are in _last

    def propose(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        (<= ``max_n``) suffix of ``ids`` that occurred before, and that suffix's length ``n``;
        ``([], 0)`` when none did."""
        end = len(ids) - 1  # the suffix ends here; index only n-grams ending before it
        last = self._last
        for e in range(self._indexed, end):
            for n in range(1, min(self.max_n, e + 1) + 1):
                last[tuple(ids[e - n + 1: e + 1])] = e
        self._indexed = max(self._indexed, end)
        for n in range(min(self.max_n, end), 0, -1):
            e = last.get(tuple(ids[end - n + 1:]))
            if e is not None:
                return ids[e + 1: e + 1 + k], n
        return [], 0


@dataclass
class _DraftSeq:
    """One request as the draft model sees it: ``fill_ids[i]`` has its KV at ``slots[i]``
    (the shape :class:`sgrt.engine.model_runner.ModelRunner` reads through a ``Row``)."""

    fill_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` (what a ``Row`` feeds, as :meth:`sgrt.engine.request.Req.fill_slice`)."""
        return self.fill_ids[start:end]


class DraftModelDrafter:
    """Propose tokens with a draft model.

    Args:
        loaded: the draft :class:`sgrt.models.LoadedModel` (same tokenizer as the target).
        num_slots: size of the draft model's own KV pool, in tokens.
        target_vocab_size: the target's logits width; draft distributions are cut or padded
            to it, and the draft never proposes an id the target does not have.
    """

    def __init__(self, loaded: Any, num_slots: int, target_vocab_size: int):
        cfg = loaded.config
        self.loaded = loaded
        self.context_length = cfg.max_position_embeddings
        self.pool = KVPool(num_slots, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                           loaded.model.dtype, loaded.model.device)
        self.runner = ModelRunner(loaded.model, self.pool)
        self.vocab_size = target_vocab_size
        self._seqs: dict[str, _DraftSeq] = {}

    def release(self, request_id: str) -> None:
        """Free the draft KV of a request that finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(seq.slots)

    def num_held(self) -> int:
        """Draft KV slots held for requests (for integrity checks)."""
        return sum(len(s.slots) for s in self._seqs.values())

    @torch.inference_mode()
    def propose(self, reqs: list[Any], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Draft ``ks[i]`` tokens for ``reqs[i]``; return per request ``(tokens, probs)``, where
        ``probs`` ``[len(tokens), V]`` holds the distributions sampled from (None when the
        request is greedy: the draft is then the draft model's argmax, a point mass).
        A request whose KV does not fit the draft pool gets no draft."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in reqs]
        rows: dict[int, Row] = {}
        for i, (req, k) in enumerate(zip(reqs, ks)):
            caught = self._catch_up(req, k)
            if caught is not None:
                seq, start = caught
                rows[i] = Row(seq, start, len(seq.fill_ids) - start)
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        step = 0
        while rows:
            order = list(rows)
            logits = self.runner.forward([rows[i] for i in order], [[rows[i].n - 1] for i in order])
            nxt: dict[int, Row] = {}
            for i, lg in zip(order, logits):
                req, seq = reqs[i], rows[i].req
                t, q = self._choose(lg[0], req)
                out[i][0].append(t)
                if q is not None:
                    probs[i].append(q)
                if step + 1 < ks[i]:
                    seq.fill_ids.append(t)
                    seq.slots.extend(self.pool.alloc(1))
                    nxt[i] = Row(seq, len(seq.fill_ids) - 1, 1)
            rows = nxt
            step += 1
        return [(toks, torch.stack(probs[i]) if probs.get(i) else None) for i, (toks, _) in enumerate(out)]

    def _catch_up(self, req: Any, k: int) -> tuple[_DraftSeq, int] | None:
        """Reuse the draft KV of the longest common prefix with ``req.fill_ids``, free the rest,
        and allocate slots for the tokens to feed now; return the sequence and where its new
        tokens start, or None if the pool is too small."""
        ids = req.fill_ids
        seq = self._seqs.setdefault(req.request_id, _DraftSeq())
        common = min(common_prefix_len(seq.fill_ids, ids), max(len(ids) - 1, 0))  # (feed one token at least: logits)
        self.pool.free(seq.slots[common:])
        del seq.slots[common:]
        need = len(ids) - common + k - 1
        if need > self.pool.num_free or len(ids) + k > self.context_length:
            seq.fill_ids = seq.fill_ids[:common]
            return None
        seq.fill_ids = list(ids)
        seq.slots.extend(self.pool.alloc(len(ids) - common))
        return seq, common

    def _choose(self, logits: torch.Tensor, req: Any) -> tuple[int, torch.Tensor | None]:
        v = self.vocab_size
        if logits.shape[-1] > v:
            logits = logits[:v]
        elif logits.shape[-1] < v:
            logits = torch.cat([logits, logits.new_full((v - logits.shape[-1],), float("-inf"))])
        if req.params.temperature == 0.0:
            return greedy_token(logits), None
        q = sampling_probs(logits, req.params)
        q = q / q.sum()
        return int(torch.multinomial(q, 1, generator=req.generator)), q
