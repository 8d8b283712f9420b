"""What the engine hands back: a finished request's :class:`Result` and streamed :class:`StreamChunk`s."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest


@dataclass
class Result:
    """The outcome of one request.

    ``finish_reason`` is ``"stop"`` (``matched`` holds the EOS id, the stop string or stop id,
    or ``"grammar"`` when the grammar allows nothing more), ``"length"`` (``max_tokens`` reached;
    a constrained value is then ``incomplete``) or ``"abort"`` (``error`` says why).
    Times are in seconds. ``output_logprobs[i]`` is the log-probability of ``token_ids[i]``;
    ``output_top_logprobs[i]`` lists ``(token_id, logprob)`` pairs. ``prompt_logprobs`` holds, for
    each prompt position from ``logprob_start_len`` on, the log-probability of that prompt token
    given the ones before it (``None`` for position 0, which has no context).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    total_time: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    incomplete: bool = False
    error: str | None = None
    # The typed error when the request itself caused the abort (its constraint hit a grammar
    # engine limit mid-generation, ...): servers answer it as the client's error, not their own.
    request_error: InvalidRequest | None = None
    warnings: list[str] = field(default_factory=list)
    forced_tokens: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    @property
    def output_tok_per_s(self) -> float:
        """Output tokens per second after the first token (decode speed)."""
        decode_time = self.total_time - (self.ttft or 0.0)
        if self.completion_tokens <= 1 or decode_time <= 0:
            return 0.0
        return (self.completion_tokens - 1) / decode_time

    def meta_info(self, e2e_latency: float) -> dict[str, Any]:
        """The scalar part of SGLang's ``meta_info`` for this result (the DSL's
        ``get_meta_info`` and the native ``/generate`` response add log-probabilities to it)."""
        return {
            "id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "matched": self.matched,
            "incomplete": self.incomplete,
            "warnings": list(self.warnings),
            "ttft": self.ttft,
            "e2e_latency": e2e_latency,
            "forced_tokens": self.forced_tokens,
            "output_token_ids": list(self.token_ids),
        }

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


@dataclass
class StreamChunk:
    """One increment of a streamed request: new text and the tokens that produced it.

    ``text`` may be empty while a multi-byte character is incomplete. The last chunk has
    ``finished=True`` and carries the :class:`Result`.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    result: Result | None = None
