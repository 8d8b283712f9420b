"""The interface every DSL backend implements, and the plain records that cross it.

A backend is where a program's model calls go. The interpreter (``sgrt.lang``) speaks only
this interface, in text and typed records, so that the in-process engine (``LocalBackend``) and
a remote OpenAI-compatible server (the HTTP backend) are interchangeable:

- prompts are text (the program's transcript, chat template already applied);
- sampling options are one :class:`sgrt.sampling_params.SamplingParams`, built and checked
  once by the DSL (``sgrt.lang.defaults.gen_sampling_params``); a plain dict of its fields is
  still taken (:func:`as_sampling_params`) for callers of the backends' own API. Its
  ``stop_regex`` is the backends' to apply (the engine has no such field);
- results are :class:`GenOutput`, :class:`GenChunk` and :class:`ChoiceScore` records whose
  ``meta_info`` keys follow SGLang's (``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``, ``finish_reason``, ``output_token_logprobs`` ...).

Deciding a ``select`` from the scores is the DSL's job (``sgrt.lang.choices``); the backend only
scores. Nothing here imports the engine.
"""
from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest
from sgrt.sampling_params import SamplingParams

#: What the ``generate*`` methods take: a :class:`SamplingParams`, or a dict of its fields.
ParamsLike = SamplingParams | dict[str, Any]

#: A sampled token's log-probability as the DSL reports it: ``(logprob, token_id, token_text)``.
TokenLogprob = tuple[float, int, str]


@dataclass
class GenOutput:
    """One finished completion.

    ``meta_info`` holds at least ``id``, ``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens``, ``finish_reason`` (``"stop"`` / ``"length"``), ``matched``,
    ``e2e_latency`` (s), ``ttft`` (s), ``incomplete`` and ``warnings``; with ``return_logprob``
    also ``output_token_logprobs`` (list of :data:`TokenLogprob`) and, with
    ``top_logprobs_num``, ``output_top_logprobs`` (per position, a list of
    :data:`TokenLogprob`); with ``return_logprob`` and ``logprob_start_len >= 0`` (a backend
    that has prompt log-probabilities) also ``input_token_logprobs``, the prompt's tokens from
    that position (the first prompt token's log-probability ``None``), and with
    ``top_logprobs_num`` ``input_top_logprobs``. The DSL reshapes it for programs
    (``sgrt.lang.meta_info``).
    """

    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenChunk:
    """One increment of a streamed completion.

    ``text`` is the new text (may be empty while a multi-byte character is incomplete);
    ``token_ids`` the tokens that produced it, ``logprobs`` their log-probabilities (when asked
    for, aligned with ``token_ids``), ``top_logprobs`` per token. The last chunk has
    ``finished=True`` and ``meta_info`` as :class:`GenOutput` describes it.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None
    finished: bool = False
    meta_info: dict[str, Any] | None = None


@dataclass
class ChoiceScore:
    """How likely one ``select`` option is after a prompt.

    ``token_logprobs`` are the log-probabilities of the option's own tokens given the prompt
    (what ``prompt + choice`` tokenizes to past the prompt's tokens; with token healing the
    first one may re-cover the prompt's last characters). ``unconditional_logprobs``, when
    asked for, are those of the same tokens (``token_ids``) scored on their own (first entry
    ``None``: no context), as SGLang's ``RuntimeEndpoint.select`` scores them; a backend that
    can only score text pads or cuts them to ``token_logprobs``' length. ``cached_tokens`` is
    how much of the scoring request came from the prefix cache.
    """

    choice: str
    token_ids: list[int]
    token_logprobs: list[float]
    token_texts: list[str] = field(default_factory=list)
    unconditional_logprobs: list[float | None] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class TokenUsage:
    """Tokens a backend's generations used (SGLang's ``backend.token_usage``), summed over every
    ``gen`` and ``select`` the DSL ran on it. Thread-safe; :meth:`reset` zeroes it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        with self._lock:
            self.prompt_tokens += int(prompt_tokens or 0)
            self.completion_tokens += int(completion_tokens or 0)

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = 0
            self.completion_tokens = 0


class BaseBackend(ABC):
    """Where a program's calls go. Thread-safe: forks and ``run_batch`` call it concurrently.

    Subclasses implement :meth:`apply_chat_template`, :meth:`generate`,
    :meth:`generate_stream`, :meth:`score_choices` and :meth:`cache_prefix`; the rest have
    working defaults built on those.
    """

    #: An explicit ``sgrt.lang.ChatTemplate`` to use instead of deriving one from
    #: :meth:`apply_chat_template` (set it for models whose template cannot be probed).
    chat_template: Any = None

    #: Whether the model takes images / video (``sgrt.image``); no model sgrt loads does.
    supports_vision: bool = False

    @property
    def token_usage(self) -> TokenUsage:
        """Tokens used so far by the DSL's calls on this backend (see :class:`TokenUsage`)."""
        usage = self.__dict__.get("_token_usage")
        if usage is None:
            usage = self.__dict__.setdefault("_token_usage", TokenUsage())
        return usage

    @property
    def endpoint(self) -> "BaseBackend":
        """The backend itself: SGLang's ``Runtime`` hands programs ``runtime.endpoint``, and its
        programs reach it as ``global_config.default_backend.endpoint``."""
        return self

    def get_model_name(self) -> str:
        """The model's path or name (SGLang's ``get_model_name()``, ``model_info["model_path"]``)."""
        return str(self.get_server_info().get("model_path", ""))

    # ---- chat template --------------------------------------------------------------------

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render OpenAI-style ``messages`` with the model's chat template, as text.

        The DSL calls it only with sentinel contents, to learn each role's prefix and suffix
        (``sgrt.lang.chat_template.derive_chat_template``).

        Raises:
            InvalidRequest: the model has no chat template.
        """

    def bos_token(self) -> str | None:
        """The text of the BOS token, which role prefixes must not repeat; ``None`` if none."""
        return None

    # ---- generation -----------------------------------------------------------------------

    @abstractmethod
    def generate(self, prompt: str, params: ParamsLike,
                 request_id: str | None = None) -> GenOutput:
        """Complete ``prompt`` under ``params`` (SamplingParams field names) and wait.

        Raises:
            InvalidRequest / GrammarError: a bad parameter or a constraint that cannot compile.
            ContextLengthExceeded: the prompt does not fit.
            RequestAborted: the request was aborted or failed (``__cause__`` / message say why).
        """

    def generate_batch(self, prompts: Sequence[str],
                       params: Sequence[ParamsLike]) -> list[GenOutput]:
        """Complete several prompts; a backend that can should run them concurrently.

        The default runs them one after another. Errors as :meth:`generate`.
        """
        return [self.generate(p, sp) for p, sp in zip(prompts, params)]

    @abstractmethod
    def generate_stream(self, prompt: str, params: ParamsLike,
                        request_id: str | None = None) -> Iterator[GenChunk]:
        """Complete ``prompt``, yielding :class:`GenChunk` s; the last has ``finished=True``.

        Closing the iterator early aborts the request. Errors as :meth:`generate`, raised from
        the iteration.
        """

    def next_token_stream(self, prompt: str, params: SamplingParams,
                          request_id: str | None = None) -> Iterator[GenChunk]:
        """The stream of a next-token request (:func:`next_token_request` said so): one finished
        :class:`GenChunk` with no text, carrying :meth:`generate`'s meta (its top logprobs)."""
        out = self.generate(prompt, params.replace(max_tokens=0), request_id)
        return iter([GenChunk("", [], None, None, True, out.meta_info)])

    # ---- select ---------------------------------------------------------------------------

    @abstractmethod
    def score_choices(self, prompt: str, choices: Sequence[str],
                      unconditional: bool = False) -> list[ChoiceScore]:
        """Score each option of a ``select`` by its tokens' log-probabilities after ``prompt``.

        A backend with a prefix cache prefills the shared ``prompt`` once and then scores all
        options as one batch of prefill-only requests. With ``unconditional``, also scores each
        option's tokens without the prompt.
        """

    # ---- prefix cache ---------------------------------------------------------------------

    @abstractmethod
    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        """Prefill ``prompt`` into the prefix cache (a prefill-only request) and wait.

        Returns meta info with ``prompt_tokens`` and ``cached_tokens``. A backend without a
        prefix cache returns ``{}`` and does nothing.
        """

    def commit_fork(self, prompt: str, num_branches: int) -> dict[str, Any]:
        """Make ``prompt`` (the text at a ``fork``) shared by the branches about to start.

        The default caches it (:meth:`cache_prefix`), so that each branch prefills only its own
        tokens.
        """
        return self.cache_prefix(prompt)

    def flush_cache(self, empty_cache: bool = True) -> None:
        """Drop everything from the prefix cache (no-op by default). ``empty_cache`` (SGLang's
        flag) also releases the accelerator's cached memory where there is one."""

    # ---- control --------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Abort a running request; unknown or finished ids are ignored (no-op by default)."""

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is as a prompt.

        Raises:
            InvalidRequest: the backend cannot tokenize.
        """
        raise InvalidRequest(f"{type(self).__name__} cannot count tokens", field="text")

    def get_server_info(self) -> dict[str, Any]:
        """Facts about the model and the serving engine (model name, stats)."""
        return {}

    def shutdown(self) -> None:
        """Release what the backend holds (no-op by default)."""


# ---- helpers the backends share for SGLang's keywords --------------------------------------

def as_sampling_params(params: ParamsLike) -> SamplingParams:
    """``params`` as a :class:`SamplingParams`: itself, or built (so checked) from a dict.

    Raises:
        InvalidRequest: an unknown or bad field, named; anything else than the two types.
    """
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise InvalidRequest(f"params must be SamplingParams or dict, got {type(params).__name__}", field="params")


def split_stop_regex(params: ParamsLike) -> tuple[SamplingParams, list[re.Pattern]]:
    """``params`` without ``stop_regex`` (the engine has no such field) and its compiled
    patterns."""
    params = as_sampling_params(params)
    if not params.stop_regex:
        return params, []
    return params.replace(stop_regex=[]), [re.compile(p) for p in params.stop_regex]


def regex_stop_point(text: str, done: int, patterns: Sequence[re.Pattern]) -> tuple[int, str] | None:
    """Where a ``stop_regex`` ends the text: the shortest prefix of ``text``, longer than ``done``
    characters (already checked), that contains a match of any pattern, as ``(length, pattern)``;
    ``None`` if there is no match.

    This is SGLang's rule (the server checks the decoded output after every token and stops at
    the first one that completes a match) at character granularity.
    """
    hits = [p for p in patterns if p.search(text)]
    if not hits:
        return None
    for length in range(done + 1, len(text) + 1):
        prefix = text[:length]
        for p in hits:
            if p.search(prefix):
                return length, p.pattern
    return len(text), hits[0].pattern


def next_token_request(params: SamplingParams) -> tuple[SamplingParams, bool]:
    """Rewrite SGLang's ``max_tokens=0, return_logprob=True, top_logprobs_num=k`` (the k most
    likely next tokens after the prompt, nothing generated) into a one-token request.

    Returns ``(params, True)`` when rewritten: the caller runs it and passes the output through
    :func:`strip_next_token`. The one token ignores stop strings and EOS, so that its top
    log-probabilities always come back.
    """
    if params.max_tokens == 0 and params.return_logprob and params.top_logprobs_num > 0:
        return params.replace(max_tokens=1, min_tokens=0, stop=[], ignore_eos=True), True
    return params, False


def strip_next_token(meta: dict[str, Any]) -> dict[str, Any]:
    """The meta info of a rewritten :func:`next_token_request`: no output token, only the top
    log-probabilities of the next position (``output_top_logprobs[0]``)."""
    out = dict(meta)
    out["completion_tokens"] = 0
    out["output_token_ids"] = []
    out["output_token_logprobs"] = []
    out["output_top_logprobs"] = list(meta.get("output_top_logprobs") or [])[:1]
    out["finish_reason"] = "length"
    out["matched"] = None
    return out


def stop_stream_at_regex(chunks: Iterator[GenChunk], patterns: Sequence[re.Pattern],
                         stopped_meta: Callable[[str, int, str], dict[str, Any]]) -> Iterator[GenChunk]:
    """Pass ``chunks`` through until the text contains a ``stop_regex`` match, then cut the
    chunk there, close ``chunks`` (which aborts the request) and end with a finished chunk whose
    meta info is ``stopped_meta(text, completion_tokens, pattern)`` (``finish_reason`` ``"stop"``,
    ``matched`` the pattern)."""
    text = ""
    n_tokens = 0
    try:
        for chunk in chunks:
            new_text = text + chunk.text
            point = regex_stop_point(new_text, len(text), patterns) if chunk.text else None
            if point is None:
                text = new_text
                n_tokens += len(chunk.token_ids)
                if chunk.finished and chunk.meta_info is not None:
                    chunk.meta_info.setdefault("matched", None)
                yield chunk
                if chunk.finished:
                    return
                continue
            length, pattern = point
            piece = new_text[len(text):length]
            text = new_text[:length]
            n_tokens += len(chunk.token_ids)
            meta = stopped_meta(text, n_tokens, pattern)
            yield GenChunk(piece, list(chunk.token_ids), chunk.logprobs, chunk.top_logprobs, False, None)
            yield GenChunk("", [], None, None, True, meta)
            return
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
