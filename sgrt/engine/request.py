"""A request's mutable state while the engine serves it (owned by the engine loop thread)."""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from sgrt.engine.outputs import Result
from sgrt.engine.sampling_params import SamplingParams
from sgrt.errors import InvalidRequest


class ReqStatus(Enum):
    WAITING = "waiting"  # queued, holds no slots of its own
    RUNNING = "running"  # admitted: prefilling (chunk by chunk) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One generation request.

    Token bookkeeping: ``fill_ids = prompt_ids + output_ids`` is everything the model has seen or
    produced. ``slots[i]`` is the KV slot of ``fill_ids[i]`` for ``i < len(slots)`` (KV computed
    or being computed this step). The first ``cached_len`` slots belong to the radix cache and are
    locked through ``last_node``; the rest belong to the request. The scheduler alone changes
    ``slots``, ``cached_len`` and ``last_node``.

    ``slots`` is an int64 ``array.array`` (typecode ``"q"``), not a list: every forward copies a
    row's slots into its slot table, and an array's copy is one memcpy, where a list's is a
    conversion of each Python int (8,000 slots: ~1 against ~100 us, each decode step).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    slots: array = field(default_factory=lambda: array("q"))
    cached_len: int = 0
    last_node: Any = None  # the prefix-cache handle locked for this request (MatchResult.node)
    status: ReqStatus = ReqStatus.WAITING
    grammar: Any = None  # sgrt.constrained.Grammar, or None when unconstrained
    grammar_future: Any = None  # concurrent.futures.Future while the grammar compiles
    detokenizer: Any = None
    # the stop strings' automaton (sgrt.engine.stop_matcher.StopMatcher), fed every new piece of
    # ``text``; built at intake (or on first use) when params.stop is set
    stop_matcher: Any = None
    channel: Any = None  # RequestChannel: where results and stream chunks go
    # Results being built
    text: str = ""  # detokenized output so far (stop strings not yet cut)
    sent_len: int = 0  # characters of ``text`` already streamed
    sent_tokens: int = 0  # output tokens already streamed
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_cached_tokens: int = -1  # cached tokens at first admission (metrics)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    error: BaseException | None = None
    incomplete: bool = False
    forced_tokens: int = 0
    prefill_skips: int = 0  # steps the scheduler passed this prefill over, running or waiting (policy "short")
    spec_drafted: int = 0
    spec_accepted: int = 0
    warnings: list[str] = field(default_factory=list)
    generator: Any = None  # torch.Generator when seeded

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]``, sliced from the prompt and the output without building
        ``fill_ids`` (a decode step feeds one token; building it would copy the whole context)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p: end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_fill(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_prefill(self) -> int:
        """Tokens that still need a forward before the next sample (>= 1 while running)."""
        return self.num_fill - len(self.slots)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def to_result(self, text: str) -> Result:
        end = time.monotonic()
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        itl = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return Result(
            request_id=self.request_id,
            text=text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            matched=self.matched,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=max(self.prompt_cached_tokens, 0),
            ttft=ttft,
            total_time=end - self.arrival,
            itl=itl,
            output_logprobs=list(self.output_logprobs) if self.params.return_logprob else None,
            output_top_logprobs=list(self.output_top_logprobs)
            if self.params.return_logprob and self.params.top_logprobs_num
            else None,
            prompt_token_ids=list(self.prompt_ids),
            prompt_logprobs=list(self.prompt_logprobs) if self.params.logprob_start_len >= 0 else None,
            prompt_top_logprobs=list(self.prompt_top_logprobs)
            if self.params.logprob_start_len >= 0 and self.params.top_logprobs_num
            else None,
            incomplete=self.incomplete,
            error=None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            request_error=self.error if isinstance(self.error, InvalidRequest) else None,
            warnings=list(self.warnings),
            forced_tokens=self.forced_tokens,
            spec_drafted=self.spec_drafted,
            spec_accepted=self.spec_accepted,
        )
