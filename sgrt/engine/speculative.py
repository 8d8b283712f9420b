"""Speculative decoding and jump-forward inside the continuous batch: the draft planner.

:class:`SpecPlanner` decides; it owns no KV slot and appends no token. The scheduler reserves
and releases the KV slots of draft tokens; the output processor appends what verification keeps
(DESIGN.md, "Draft / verify", "Jump-forward" and "The path of one gen"). Its parts, in the
order a step calls them:

* :meth:`SpecPlanner.plan_text_jumps` before scheduling: requests in *text* jump-forward mode
  get the grammar's forced tokens (all but a last token that a longer allowed token could
  extend), which the output processor appends without verification; their KV is computed by
  the next forward like a prefill chunk.
* :meth:`SpecPlanner.plan` after scheduling: a row that is about to sample becomes a *verify
  row* of ``k + 1`` tokens: the grammar's forced text, tokenized (*exact* jump-forward,
  constrained requests; also before the first output token, when the prompt's last prefill
  chunk verifies it), or a drafter's proposal (``speculative="ngram" | "draft"``, from the
  second output token), cut at the first token the grammar forbids; the scheduler reserves
  ``k`` KV slots for it (:meth:`sgrt.engine.scheduler.Scheduler.attach_draft`).
* :meth:`SpecPlanner.verify` after the forward: :func:`sgrt.engine.verify.verify` keeps the
  accepted prefix plus one target token; the scheduler releases the rejected drafts' KV slots;
  the output processor appends the kept tokens one by one, so stop strings, EOS,
  ``max_tokens`` and grammar termination are checked exactly as without speculation.
* :meth:`SpecPlanner.forget` when the loop retires a finished request (its acceptance
  statistics go, and its KV in the draft model's own pool).

Draft length and turning off under load, one rule (the cost model of Leviathan et al.,
arXiv:2211.17192, section 3.4, applied to a whole batch). In units of a batch-1 one-token
forward, a forward over ``T`` tokens costs ``1 + gamma * (T - 1)``, plus ``switch`` when drafts
turn a one-token forward into a longer one (a matrix-vector product becomes a matrix product;
attention needs a mask). ``speculative_cost = (switch, gamma)``: on CPU (0.37, 0.055), measured
for the default model in float32 (CPU time of one thread: 4 tokens cost 1.45 one-token forwards,
8 tokens 1.75, 16 tokens 2.2, 32 tokens 3.1; oddly, 2 and 3 tokens cost 1.8 and 2.2 there); on
CUDA (0, 0.005), an estimate.

Each request keeps ``alpha``, a smoothed estimate of the chance that its next draft token is
accepted (accepted draft tokens / (accepted + rejections), decayed, prior 0.5), one per draft
source: the draft model, or the order (3, 2, 1) of the n-gram match. The ``j``-th draft token is
accepted with probability about ``alpha ** j``; granting it raises the step's expected yield
``Y`` by that and its cost ``C`` by ``gamma``, so it pays when ``alpha ** j * C > gamma * Y``.
:func:`plan_draft_lengths` grants draft tokens greedily, best first, up to ``num_draft_tokens``
per request, then drops them all if ``Y / C`` does not beat the step without drafts (the switch
cost). So drafts grow while they are accepted, shrink when they are not, and stop as the batch
grows: with ``B`` decode rows the first draft token must beat ``gamma * B / (1 + gamma * (B -
1))``, which for ``gamma = 0.055`` passes 0.6 above 25 rows and 0.8 above 68. A request that
drafts nothing drifts back to the prior and probes again. Exact jump-forward is exempt: a forced
run is nearly always accepted.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import torch

from sgrt.engine.drafters import DraftModelDrafter, NgramIndex
from sgrt.engine.request import Req
from sgrt.engine.scheduler import Row, Scheduler
from sgrt.engine.verify import Draft, VerifyOutput, token_allowed, verify, walk_grammar
from sgrt.errors import InvalidRequest

# Forward cost model (module docstring): (switch, per token), in units of a batch-1 one-token
# forward. CPU: measured (default model, float32, one thread, CPU time of 1..32-token forwards).
CPU_COST = (0.37, 0.055)
CUDA_COST = (0.0, 0.005)  # NOTE: an estimate (a small model's GPU forward is launch-bound), not measured here
PRIOR_ACCEPTED, PRIOR_REJECTED = 0.5, 0.5  # pseudo-counts: alpha starts at 0.5
DECAY = 0.9  # weight of past verifications at each new one
# NOTE: per step without a draft, drift back towards the prior. At batch 1 on CPU a draft needs
# alpha > ~0.36 to pay for the switch cost; a request whose drafts are always rejected then
# probes again about every 23 steps (after a long bad run, after ~60).
IDLE_DECAY = 0.95
MODEL_SOURCE = 0  # acceptance statistics of draft-model drafts; n-gram drafts use their match order


@dataclass
class SpecState:
    """Per-request acceptance statistics, one pair per draft source (the draft model, or the
    order 1..3 of the n-gram match that proposed the draft), and the n-gram index."""

    accepted: list[float] = field(default_factory=lambda: [0.0] * 4)  # decayed accepted draft tokens
    rejected: list[float] = field(default_factory=lambda: [0.0] * 4)  # decayed drafts cut short
    ngram: NgramIndex = field(default_factory=NgramIndex)

    def alpha(self, source: int) -> float:
        """Estimated probability that the next draft token from ``source`` is accepted."""
        a, r = self.accepted[source], self.rejected[source]
        return (a + PRIOR_ACCEPTED) / (a + r + PRIOR_ACCEPTED + PRIOR_REJECTED)

    def update(self, source: int, drafted: int, accepted: int) -> None:
        """Record a verification: ``accepted`` of ``drafted`` tokens from ``source`` kept."""
        self.accepted[source] = DECAY * self.accepted[source] + accepted
        self.rejected[source] = DECAY * self.rejected[source] + (accepted < drafted)

    def idle(self) -> None:
        """A step without a draft: every estimate drifts back towards the prior."""
        self.accepted = [a * IDLE_DECAY for a in self.accepted]
        self.rejected = [r * IDLE_DECAY for r in self.rejected]


def plan_draft_lengths(alphas: list[float], caps: list[int], num_sampling: int, num_tokens: int,
                       cost: tuple[float, float]) -> list[int]:
    """Draft length per request for one step (see the module docstring).

    Args:
        alphas: per candidate request, the estimated acceptance probability of a draft token.
        caps: per candidate, the most draft tokens it may take.
        num_sampling: rows that sample this step (each yields at least one token).
        num_tokens: tokens the forward feeds before any draft (prefill chunks included).
        cost: ``(switch, per_token)``: a forward over ``T`` tokens costs ``1 + per_token *
            (T - 1)``, plus ``switch`` when drafts turn a one-token forward into a longer one.
    """
    switch, gamma = cost
    lengths = [0] * len(alphas)
    base = 1.0 + gamma * (num_tokens - 1)
    y = float(num_sampling)
    c = base + (switch if num_tokens == 1 else 0.0)
    heap = [(-a, i) for i, a in enumerate(alphas) if caps[i] > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if gain * c <= gamma * y:
            break  # (y + gain) / (c + gamma) <= y / c: the best remaining token does not pay
        lengths[i] += 1
        y += gain
        c += gamma
        if lengths[i] < caps[i]:
            heapq.heappush(heap, (-(gain * alphas[i]), i))
    if any(lengths) and y / c <= num_sampling / base:
        return [0] * len(alphas)  # the drafts do not pay for the switch to a longer forward
    return lengths


@dataclass
class SpecConfig:
    """Speculative decoding and jump-forward options (fields of the same names in
    :class:`sgrt.engine.engine.EngineConfig`; the module docstring explains the cost model).

    Attributes:
        speculative: the drafter of requests that set none: ``"ngram"``, ``"draft"`` or None.
        num_draft_tokens: the most draft tokens per request and step, in [1, 16].
        draft_model: the draft model: a spec for :func:`sgrt.models.load_model` or a
            ``LoadedModel`` with the target's tokenizer (needed by ``"draft"``).
        draft_max_total_tokens: the draft model's KV pool size in tokens (None: the target's
            ``max_total_tokens + 16 * max_running_requests``).
        speculative_cost: the forward cost model ``(switch, per_token)``, two numbers >= 0
            (None: :data:`CPU_COST`, or :data:`CUDA_COST` on a CUDA device).
        max_jump_forward_tokens: the longest forced run one jump-forward takes (>= 0; 0 turns
            jump-forward off).

    Raises:
        InvalidRequest: a field out of its range (named).
    """

    speculative: str | None = None
    num_draft_tokens: int = 8
    draft_model: Any = None
    draft_max_total_tokens: int | None = None
    speculative_cost: tuple[float, float] | None = None
    max_jump_forward_tokens: int = 16

    def __post_init__(self) -> None:
        from sgrt.engine.sampling_params import check_speculative

        if self.num_draft_tokens is None:  # None means "the engine's default" only on a request
            raise InvalidRequest("num_draft_tokens must be an int in [1, 16], got None", field="num_draft_tokens")
        check_speculative(self.speculative, self.num_draft_tokens, has_draft_model=self.draft_model is not None,
                          draft_field="draft_model")
        if self.draft_max_total_tokens is not None and (
                not _is_int(self.draft_max_total_tokens) or self.draft_max_total_tokens < 1):
            raise InvalidRequest(f"draft_max_total_tokens must be an int >= 1 or None, got "
                                 f"{self.draft_max_total_tokens!r}", field="draft_max_total_tokens")
        cost = self.speculative_cost
        if cost is not None and (not isinstance(cost, (tuple, list)) or len(cost) != 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x < float("inf") for x in cost)):
            raise InvalidRequest(
                f"speculative_cost must be (switch, per_token), two numbers >= 0, got {cost!r}",
                field="speculative_cost",
            )
        if not _is_int(self.max_jump_forward_tokens) or self.max_jump_forward_tokens < 0:
            raise InvalidRequest(f"max_jump_forward_tokens must be an int >= 0, got {self.max_jump_forward_tokens!r}",
                                 field="max_jump_forward_tokens")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SpecPlanner:
    """Plans drafts and jump-forward runs, and verifies drafts, for one engine (loop thread).

    It holds per-request acceptance statistics and, with a draft model, that model's own KV
    pool (:class:`sgrt.engine.drafters.DraftModelDrafter`); the target's KV slots for draft
    tokens come from the scheduler, and the tokens it plans are appended by the output
    processor.

    Args:
        config: the validated :class:`SpecConfig`.
        scheduler: reserves and releases the KV slots of draft tokens.
        loaded: the target :class:`sgrt.models.LoadedModel` (a draft model given by spec is
            loaded with its dtype and device).
        eos_ids: the tokenizer's end ids.
        context_length: the target's context window.
        draft_slots: the draft model's KV pool size, in tokens.

    Raises:
        InvalidRequest: (field ``draft_model``) its tokenizer differs from the target's.
        ModelLoadError: the draft model could not be loaded.
    """

    def __init__(self, config: SpecConfig, scheduler: Scheduler, loaded: Any, eos_ids: set[int],
                 context_length: int, draft_slots: int):
        cost = config.speculative_cost
        if cost is None:
            cost = CUDA_COST if loaded.model.device.type == "cuda" else CPU_COST
        self.cost = (float(cost[0]), float(cost[1]))
        self.config = config
        self.scheduler = scheduler
        self.vocab_size = loaded.config.vocab_size
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.drafter: DraftModelDrafter | None = None
        if config.draft_model is not None:
            self.drafter = self._load_drafter(config.draft_model, loaded, draft_slots)
            self.context_length = min(context_length, self.drafter.context_length)
        self.tokenizer = loaded.tokenizer
        self._longer: dict[int, list[int]] = {}  # token -> ids whose bytes strictly extend it
        self._states: dict[str, SpecState] = {}

    def _load_drafter(self, draft: Any, loaded: Any, slots: int) -> DraftModelDrafter:
        from sgrt.models import LoadedModel, load_model

        if not isinstance(draft, LoadedModel):
            draft = load_model(draft, dtype=loaded.model.dtype, device=loaded.model.device)
        if len(draft.tokenizer) != len(loaded.tokenizer):
            raise InvalidRequest(
                f"draft_model's tokenizer has {len(draft.tokenizer)} tokens, the target's "
                f"{len(loaded.tokenizer)}: a draft model must share the target's tokenizer",
                field="draft_model",
            )
        return DraftModelDrafter(draft, slots, loaded.config.vocab_size)

    # -- per-request options -----------------------------------------------------------------
    def mode(self, req: Req) -> str | None:
        """The request's drafter (its own ``speculative`` or the engine's)."""
        return req.params.speculative or self.config.speculative

    def max_draft(self, req: Req) -> int:
        """The most draft tokens the request takes a step."""
        return req.params.num_draft_tokens or self.config.num_draft_tokens

    @staticmethod
    def jump_forward_mode(req: Req) -> str | None:
        """``exact`` / ``text`` / None for a constrained request (text needs no logprobs:
        unverified tokens have none, so a request that asks for logprobs gets exact)."""
        mode = req.params.jump_forward
        if req.grammar is None or mode is None:
            return None
        if mode == "text" and req.params.return_logprob:
            return "exact"
        return mode

    def _room(self, req: Req) -> int:
        """Most tokens that may still be appended after the pending last one."""
        return min(req.params.max_tokens - len(req.output_ids) - 1, self.context_length - req.num_fill)

    # -- before scheduling: text jump-forward ------------------------------------------------
    def plan_text_jumps(self, running: list[Req]) -> list[tuple[Req, list[int]]]:
        """The forced tokens to append, unverified, to decoding requests in text mode, per
        request. The run never ends where a longer token could continue it: at the end of the
        forced text, its last token is dropped when the grammar (before it) allows a token
        whose bytes strictly extend it; a run that terminates the grammar is kept whole. Each
        grammar ends in the state it started in."""
        jumps: list[tuple[Req, list[int]]] = []
        for req in running:
            if req.finished or self.jump_forward_mode(req) != "text" or not req.output_ids \
                    or req.remaining_prefill != 1:
                continue
            room = min(req.params.max_tokens - len(req.output_ids), self.context_length - req.num_fill)
            full = req.grammar.forced_tokens()
            forced = full[: min(room, self.config.max_jump_forward_tokens)]
            if not forced:
                continue
            grammar = req.grammar
            n = 0
            for t in forced:
                if not grammar.accept_token(t):
                    break
                n += 1
            keep = n
            if 0 < n == len(full) and n < room and not grammar.is_terminated():
                # The run's end: drop its last token if a longer token could continue it.
                grammar.rollback(1)
                if self._extendable(grammar, forced[n - 1]):
                    keep = n - 1
                n -= 1
            if n:
                grammar.rollback(n)
            if keep:
                jumps.append((req, forced[:keep]))
        return jumps

    def _exact_forced_draft(self, grammar: Any) -> list[int]:
        """The draft of exact jump-forward: the forced tokens, or, when the grammar forces more
        bytes than they cover (``compute_ff_tokens`` stops before a token that a longer one
        could extend, such as '":"' before a string value), the tokenizer's encoding of all
        the forced bytes. Verification keeps this exact: where the model prefers another
        token, the draft is cut there and the model's token is taken."""
        forced = grammar.forced_bytes()
        if not forced:  # the common case inside free text: one grammar query, not two
            return []
        tokens = grammar.forced_tokens()
        token_bytes = self.tokenizer.all_token_bytes()  # computed once, cached by the tokenizer
        if len(forced) <= sum(len(token_bytes[t]) for t in tokens):
            return tokens
        try:
            text = forced.decode("utf-8")
        except UnicodeDecodeError:  # ends inside a character: keep the safe tokens
            return tokens
        ids = self.tokenizer.encode(text)
        if b"".join(token_bytes[t] for t in ids) != forced:
            return tokens
        return ids

    def _extendable(self, grammar: Any, token: int) -> bool:
        """Whether the grammar, in its current state, allows a token whose bytes strictly
        extend ``token``'s bytes."""
        longer = self._longer.get(token)
        if longer is None:
            token_bytes = self.tokenizer.all_token_bytes()
            prefix = token_bytes[token]
            longer = [i for i, b in enumerate(token_bytes) if len(b) > len(prefix) and b.startswith(prefix)]
            self._longer[token] = longer
        if not longer:
            return False
        from sgrt.constrained import allocate_token_bitmask

        mask = allocate_token_bitmask(1, self.vocab_size)
        grammar.fill_vocab_mask(mask, 0)
        return any(token_allowed(mask, 0, t) for t in longer if t < self.vocab_size)

    # -- after scheduling: drafts ------------------------------------------------------------
    def plan(self, rows: list[Row]) -> dict[str, Draft]:
        """Turn rows that sample this step into verify rows where a draft is worth it; return
        each attached draft by request id (the scheduler has extended its row and reserved its
        KV slots)."""
        sampling = [r for r in rows if r.completes_fill and r.req.params.max_tokens > 0]
        # NOTE: exact jump-forward also drafts the first output tokens, verified by the prefill
        # forward itself (e.g. '{"name":"' of a JSON object); speculation waits for one output.
        candidates = [r for r in sampling if not r.draft and self._room(r.req) > 0
                      and (r.req.output_ids or self.jump_forward_mode(r.req) == "exact")]
        if not candidates:
            return {}
        drafts: list[tuple[Row, Draft]] = []
        speculative: list[tuple[Row, SpecState]] = []
        for row in candidates:
            req = row.req
            if self.jump_forward_mode(req) == "exact":
                forced = self._exact_forced_draft(req.grammar)[: self.config.max_jump_forward_tokens]
                if forced:
                    drafts.append((row, Draft(tokens=forced, num_forced=len(forced))))
                    continue
            if self.mode(req) is None or not req.output_ids:
                continue
            state = self._states.get(req.request_id)
            if state is None:
                state = self._states[req.request_id] = SpecState()
            speculative.append((row, state))
        if not speculative and not drafts:
            return {}
        # n-gram proposals first (cheap): their match order tells which estimate applies.
        alphas: list[float] = []
        caps: list[int] = []
        proposed: list[tuple[list[int], int]] = []
        for row, state in speculative:
            cap = min(self.max_draft(row.req), self._room(row.req))
            if self.mode(row.req) == "draft":
                tokens, source = [], MODEL_SOURCE
            else:
                tokens, source = state.ngram.propose(row.req.fill_ids, cap)
                cap = len(tokens)
            proposed.append((tokens, source))
            alphas.append(state.alpha(source))
            caps.append(cap)
        fed = sum(r.n for r in rows) + sum(len(d.tokens) for _, d in drafts)
        lengths = plan_draft_lengths(alphas, caps, len(sampling), fed, self.cost)
        model_rows: list[tuple[Row, int]] = []
        for (row, state), k, (tokens, source) in zip(speculative, lengths, proposed):
            if k <= 0:
                state.idle()
            elif self.mode(row.req) == "draft":
                model_rows.append((row, k))
            else:
                drafts.append((row, Draft(tokens=tokens[:k], source=source)))
        if model_rows:
            proposals = self.drafter.propose([r.req for r, _ in model_rows], [k for _, k in model_rows])
            for (row, _), (tokens, probs) in zip(model_rows, proposals):
                if tokens:
                    drafts.append((row, Draft(tokens=tokens, probs=probs, source=MODEL_SOURCE)))
        planned: dict[str, Draft] = {}
        for row, draft in drafts:
            if self._attach(row, draft):
                planned[row.req.request_id] = draft
        return planned

    def _attach(self, row: Row, draft: Draft) -> bool:
        """Cut ``draft`` to what may be kept (room, an end token, the grammar) and ask the
        scheduler to extend the row with it; False when nothing is left or no slots are."""
        req = row.req
        draft.tokens = draft.tokens[: self._room(req)]
        params = req.params
        for i, t in enumerate(draft.tokens):
            if t in params.stop_token_ids or (t in self.eos_ids and not params.ignore_eos):
                draft.tokens = draft.tokens[: i + 1]  # nothing after an end token can be kept
                break
        if req.grammar is not None:
            walked = walk_grammar(req.grammar, draft.tokens, self.vocab_size)
            draft.tokens, draft.masks, draft.terminal = walked.tokens, walked.masks, walked.terminal
        k = len(draft.tokens)
        if k == 0:
            return False
        draft.num_forced = min(draft.num_forced, k)
        if draft.probs is not None:
            draft.probs = draft.probs[:k]
        return self.scheduler.attach_draft(row, draft.tokens)

    # -- after the forward: verification -----------------------------------------------------
    def verify(self, row: Row, draft: Draft, logits: torch.Tensor) -> VerifyOutput:
        """Verify a verify row's ``draft`` against its logits ``[k + 1, V]`` float32; update
        the request's acceptance estimate and have the scheduler release the rejected draft
        tokens' KV slots. The caller appends ``tokens`` of the result."""
        req = row.req
        out = verify(logits, req, draft, self.eos_ids)
        drafted = len(draft.tokens) - draft.num_forced
        if drafted:
            accepted = max(out.num_accepted - draft.num_forced, 0)
            state = self._states.get(req.request_id)
            if state is not None:
                state.update(draft.source, drafted, accepted)
        self.scheduler.release_draft_slots(req, len(draft.tokens) - out.num_accepted)
        return out

    # -- bookkeeping -------------------------------------------------------------------------
    def forget(self, req: Req) -> None:
        """Forget a finished request (its draft-model KV is freed)."""
        self._states.pop(req.request_id, None)
        if self.drafter is not None:
            self.drafter.release(req.request_id)

    def check_integrity(self) -> None:
        """Every draft-model KV slot is free or held by exactly one request (``AssertionError``)."""
        if self.drafter is None:
            return
        pool = self.drafter.pool
        held = [s for seq in self.drafter._seqs.values() for s in seq.slots]
        everything = list(pool.free_slot_set()) + held
        assert len(everything) == len(set(everything)) == pool.num_slots, "draft KV slots lost or shared"
