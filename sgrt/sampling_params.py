"""Per-request sampling and stopping parameters, shared by the engine, the DSL and the servers
(below all three: the DSL's ``GEN_DEFAULTS`` are read from here, so a default lives once).

Defaults follow DESIGN.md: greedy (``temperature=0``) unless a temperature is given. Field
names follow SGLang's and vLLM's ``SamplingParams`` so that their users find them where they
expect them.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest

JUMP_FORWARD_MODES = ("exact", "text", None)
SPECULATIVE_MODES = ("ngram", "draft", None)
TRUNCATE_MODES = ("left", None)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops: the one typed record that crosses from the
    DSL, the servers and the CLI into the backends and the engine.

    Lengths are in tokens. ``max_tokens=0`` makes a prefill-only request: the prompt is
    prefilled and inserted into the radix cache, nothing is generated. ``logprob_start_len``
    (>= 0) asks for the log-probabilities of the prompt's own tokens from that position;
    -1 asks for none. At most one of ``regex``, ``json_schema`` and ``grammar`` may be set.

    Checked once, when built (the constructor, :meth:`from_dict` or :meth:`replace`), and
    frozen, so that what was checked is what runs; each wire format has one translator to it
    (the DSL's ``gen``: ``sgrt.lang.defaults.gen_sampling_params``; WebSocket:
    ``sgrt.server.ws.session.ws_sampling_params``; OpenAI: ``sgrt.server.openai.adapter.build_params``; SGLang's
    ``/generate``: ``sgrt.server.sglang.fields.sampling_fields``; the CLI: ``sgrt.cli``).
    The engine adds only the check that needs the model (:meth:`check_vocab`).

    Raises:
        InvalidRequest: a bad field, naming it and the limit.
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
    # SGLang's: stop where the text matches one of these Python regexes. Applied by the DSL's
    # backends while the text streams in (sgrt.backends.base.stop_stream_at_regex); the engine
    # refuses a request that still carries it.
    stop_regex: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from a plain dict; an unknown key raises ``InvalidRequest`` naming it."""
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in names:
                raise InvalidRequest(f"unknown sampling parameter {key!r}", field=key)
        return cls(**data)

    def replace(self, **changes: Any) -> "SamplingParams":
        """Return a checked copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def is_constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.grammar is not None

    def constraint(self) -> tuple[str | None, Any]:
        """``(field, value)`` of the constraint set (``regex``, ``json_schema`` or ``grammar``),
        or ``(None, None)``; at most one is set (checked when built)."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None, None

    def to_wire_dict(self) -> dict[str, Any]:
        """The fields a remote server's request needs, by ``SamplingParams`` name: the core
        (:data:`WIRE_CORE_FIELDS`, whose defaults differ between servers) always, every other
        field where it differs from its default. ``json_schema`` is passed as given (the HTTP
        backend reads it into a dict). Lists are copies."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.name in WIRE_CORE_FIELDS or value != default:
                out[f.name] = list(value) if isinstance(value, list) else value
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """The one check that needs the model: ``stop_token_ids`` in ``[0, vocab_size)``."""
        for t in self.stop_token_ids:
            _check_int(t, "stop_token_ids", low=0, high=vocab_size - 1)

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field (run when built; ``vocab_size`` adds :meth:`check_vocab`); raise
        ``InvalidRequest`` naming the first bad one."""
        # NOTE: frozen: the list normalisations go through object.__setattr__.
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_list(stop, "stop", "a str or a list of str"))
        object.__setattr__(self, "stop_token_ids", _as_list(self.stop_token_ids, "stop_token_ids", "a list of int"))
        for name in BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequest(f"{name} must be a bool, got {value!r}", field=name)
        if self.grammar_backend is not None and not isinstance(self.grammar_backend, str):
            raise InvalidRequest(f"grammar_backend must be a str, got {self.grammar_backend!r}",
                                 field="grammar_backend")
        object.__setattr__(self, "stop_regex", check_stop_regex(self.stop_regex or []))
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
            _check_int(t, "stop_token_ids", low=0)
        if vocab_size is not None:
            self.check_vocab(vocab_size)
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
        check_sampling_ranges(self)


#: Fields :meth:`SamplingParams.to_wire_dict` always sends (the DSL's ``gen`` defaults: other
#: servers default some of them differently, e.g. ``temperature=1``).
WIRE_CORE_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                    "frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos",
                    "seed", "return_logprob", "top_logprobs_num", "logprob_start_len")


CONSTRAINT_FIELDS = ("regex", "json_schema", "grammar")

#: The flags of :class:`SamplingParams`: each must be a real bool (an int such as 5 would reach
#: the tokenizer's native code, which raises inside the engine loop).
BOOL_FIELDS = ("ignore_eos", "return_logprob", "skip_special_tokens", "no_stop_trim")


def _as_list(value: Any, name: str, expected: str) -> list:
    """``value`` (None, a list or a tuple) as a new list; anything else raises ``InvalidRequest``
    naming ``name``."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidRequest(f"{name} must be {expected}, got {value!r}", field=name)
    return list(value)


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


def check_stop_regex(stop_regex: Any) -> list[str]:
    """``stop_regex`` as a list of patterns that Python's ``re`` compiles.

    Raises:
        InvalidRequest: (field ``stop_regex``) not a str or list of str, or a bad pattern.
    """
    patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise InvalidRequest(f"stop_regex must be a str or a list of str, got {stop_regex!r}",
                             field="stop_regex")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise InvalidRequest(f"stop_regex {p!r} does not compile: {e}",
                                 field="stop_regex") from None
    return list(patterns)


# ---- ranges the engine can take -------------------------------------------------------------
# NOTE: the fields accept any Python int or float, but the engine hands them to torch: a seed
# must fit torch's 64-bit generator, a float field must be finite and, given as an int, within
# 2**53 (torch converts an int operand to int64 and overflows past 2**63).

#: torch.Generator.manual_seed's range (a 64-bit value, signed or unsigned).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1
#: Largest integer any count or length field may take (int32, what kernels index with).
INT_FIELD_MAX = (1 << 31) - 1
#: Largest integer a float field may be given as.
FLOAT_FIELD_INT_MAX = 1 << 53


def check_sampling_ranges(params: Any) -> None:
    """Check the numeric fields of a :class:`SamplingParams` (or a dict of its fields) against
    what the engine can take; types are :meth:`SamplingParams.validate`'s job (which runs this).

    Raises:
        InvalidRequest: ``seed`` outside 64 bits, a count/length field above 2**31 - 1, a
            non-finite float or an integer past 2**53 in a float field (``temperature``,
            ``top_p``, ``min_p``, penalties).
    """
    get = params.get if isinstance(params, dict) else (lambda k, d=None: getattr(params, k, d))
    _int_in(get("seed"), "seed", SEED_MIN, SEED_MAX)
    for name in ("max_tokens", "min_tokens", "top_k", "top_logprobs_num", "logprob_start_len",
                 "num_draft_tokens"):
        _int_in(get(name), name, -INT_FIELD_MAX, INT_FIELD_MAX)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        _finite(get(name), name)
    for t in get("stop_token_ids") or ():
        _int_in(t, "stop_token_ids", 0, INT_FIELD_MAX)


def _int_in(value: Any, name: str, low: int, high: int) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
        raise InvalidRequest(f"{name} must be in [{low}, {high}], got {value}", field=name)


def _finite(value: Any, name: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}", field=name)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > FLOAT_FIELD_INT_MAX:
        raise InvalidRequest(f"{name} must be a number in [-2**53, 2**53] when given as an integer, got {value}",
                             field=name)


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
