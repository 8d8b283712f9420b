"""Per-request sampling and stopping parameters, shared by the engine, the DSL and the servers
(below all three: the DSL's ``GEN_DEFAULTS`` are read from here, so a default lives once).

Defaults follow DESIGN.md: greedy (``temperature=0``) unless a temperature is given. Field
names follow SGLang's and vLLM's ``SamplingParams`` so that their users find them where they
expect them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest

JUMP_FORWARD_MODES = ("exact", "text", None)
SPECULATIVE_MODES = ("ngram", "draft", None)
TRUNCATE_MODES = ("left", None)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Lengths are in tokens. ``max_tokens=0`` makes a prefill-only request: the prompt is
    prefilled and inserted into the radix cache, nothing is generated. ``logprob_start_len``
    (>= 0) asks for the log-probabilities of the prompt's own tokens from that position;
    -1 asks for none. Exactly one of ``regex``, ``json_schema`` and ``grammar`` may be set.

    Raises:
        InvalidRequest: from :meth:`validate` or :meth:`from_dict`, naming the field.
    """

    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    # Constraints (see sgrt/constrained). json_schema: dict, JSON text, Pydantic model,
    # msgspec Struct or dataclass; grammar: Lark text or a file name in grammars/.
    regex: str | None = None
    json_schema: Any = None
    grammar: str | None = None
    grammar_backend: str | None = None
    jump_forward: str | None = "exact"
    # Speculative decoding: None uses the engine's setting.
    speculative: str | None = None
    num_draft_tokens: int | None = None
    truncate: str | None = None
    skip_special_tokens: bool = True
    # SGLang's: keep the matched stop string at the end of the text instead of cutting it off.
    no_stop_trim: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from a plain dict; an unknown key raises ``InvalidRequest`` naming it."""
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in names:
                raise InvalidRequest(f"unknown sampling parameter {key!r}", field=key)
        params = cls(**data)
        params.validate()
        return params

    def replace(self, **changes: Any) -> "SamplingParams":
        """Return a validated copy with ``changes`` applied."""
        params = dataclasses.replace(self, **changes)
        params.validate()
        return params

    def is_constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.grammar is not None

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field; raise ``InvalidRequest`` naming the first bad one."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int(self.max_tokens, "max_tokens", low=0)
        _check_int(self.min_tokens, "min_tokens", low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                field="min_tokens",
            )
        _check_number(self.temperature, "temperature", low=0.0)
        _check_int(self.top_k, "top_k", low=-1)
        if self.top_k == 0:
            raise InvalidRequest("top_k must be -1 (disabled) or >= 1, got 0", field="top_k")
        _check_number(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        _check_number(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        _check_number(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0:
            raise InvalidRequest(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                field="repetition_penalty",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check_number(value, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", field=name)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop strings must be non-empty str, got {s!r}", field="stop")
        for t in self.stop_token_ids:
            _check_int(t, "stop_token_ids", low=0, high=None if vocab_size is None else vocab_size - 1)
        if self.seed is not None:
            _check_int(self.seed, "seed")
        _check_int(self.top_logprobs_num, "top_logprobs_num", low=0, high=20)
        _check_int(self.logprob_start_len, "logprob_start_len", low=-1)
        the_constraint({"regex": self.regex, "json_schema": self.json_schema, "grammar": self.grammar})
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequest("regex must be a str", field="regex")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequest("grammar must be a str (Lark text or a file name)", field="grammar")
        if self.jump_forward not in JUMP_FORWARD_MODES:
            raise InvalidRequest(
                f"jump_forward must be one of {JUMP_FORWARD_MODES}, got {self.jump_forward!r}",
                field="jump_forward",
            )
        check_speculative(self.speculative, self.num_draft_tokens)
        if self.truncate not in TRUNCATE_MODES:
            raise InvalidRequest(
                f"truncate must be one of {TRUNCATE_MODES}, got {self.truncate!r}", field="truncate"
            )
        if not isinstance(self.no_stop_trim, bool):
            raise InvalidRequest(f"no_stop_trim must be a bool, got {self.no_stop_trim!r}", field="no_stop_trim")


CONSTRAINT_FIELDS = ("regex", "json_schema", "grammar")


def the_constraint(values: dict[str, Any], error: type[InvalidRequest] = InvalidRequest) -> tuple[str | None, Any]:
    """``(field, value)`` of the one constraint set in ``values`` (keys among
    :data:`CONSTRAINT_FIELDS`; ``None`` values are unset), or ``(None, None)``. The one check of
    "at most one constraint", for ``SamplingParams``, the grammar compiler and the OpenAI fields.

    Raises:
        InvalidRequest: (or ``error``, a subclass) more than one set; names the second field.
    """
    found = [(k, values.get(k)) for k in CONSTRAINT_FIELDS if values.get(k) is not None]
    if len(found) > 1:
        raise error(f"set at most one of regex, json_schema and grammar (got {[k for k, _ in found]})",
                    field=found[1][0])
    return found[0] if found else (None, None)


def check_speculative(speculative: Any, num_draft_tokens: Any, has_draft_model: bool | None = None,
                      draft_field: str = "speculative") -> None:
    """The one check of the speculative options, for a request (:meth:`SamplingParams.validate`)
    and for an engine's default (:class:`sgrt.engine.speculative.SpecConfig`).

    Args:
        speculative: one of :data:`SPECULATIVE_MODES`.
        num_draft_tokens: an int in [1, 16], or None (the engine's default).
        has_draft_model: whether a draft model is there (None: not known here, not checked).
        draft_field: the field an error names when ``"draft"`` has no draft model.

    Raises:
        InvalidRequest: a mode not in :data:`SPECULATIVE_MODES`, ``num_draft_tokens`` out of
            [1, 16], or ``"draft"`` without a draft model.
    """
    if speculative not in SPECULATIVE_MODES:
        raise InvalidRequest(f"speculative must be one of {SPECULATIVE_MODES}, got {speculative!r}",
                             field="speculative")
    if num_draft_tokens is not None:
        _check_int(num_draft_tokens, "num_draft_tokens", low=1, high=16)
    if speculative == "draft" and has_draft_model is False:
        raise InvalidRequest("speculative='draft' needs a draft_model (an engine started with one)",
                             field=draft_field)


def _check_int(value: Any, name: str, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an int, got {value!r}", field=name)
    if low is not None and value < low:
        raise InvalidRequest(f"{name} must be >= {low}, got {value}", field=name)
    if high is not None and value > high:
        raise InvalidRequest(f"{name} must be <= {high}, got {value}", field=name)


def _check_number(value: Any, name: str, low: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", field=name)
    if value != value:  # NaN
        raise InvalidRequest(f"{name} must not be NaN", field=name)
    if low is not None and value < low:
        raise InvalidRequest(f"{name} must be >= {low}, got {value}", field=name)
