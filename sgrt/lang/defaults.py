"""The one place where the DSL's defaults live, and how a ``gen`` gets its sampling options.

A ``gen`` option that the call leaves unset is taken from ``run()`` (or ``run_batch()``), and
one that ``run()`` leaves unset from :data:`GEN_DEFAULTS`. They follow DESIGN.md: greedy
decoding unless a temperature is given, no stop strings added behind the user's back, and
``max_tokens=128``.
"""
from __future__ import annotations

import warnings
from typing import Any

from sgrt.errors import InvalidRequest
from sgrt.sampling_params import SamplingParams, check_stop_regex  # noqa: F401 - re-exported

#: Sampling options a ``gen`` inherits when neither it nor ``run()`` sets them: the defaults of
#: ``sgrt.sampling_params.SamplingParams`` (one place for them; ``stop_regex`` is one, applied
#: by the backends), and the interpreter's ``return_text_in_logprobs``. Greedy: SGLang's
#: frontend silently samples at 1.0 here; we do not.
_ENGINE_DEFAULTS = SamplingParams()
GEN_DEFAULTS: dict[str, Any] = {
    **{name: getattr(_ENGINE_DEFAULTS, name) for name in (
        "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
        "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "seed", "return_logprob",
        "top_logprobs_num", "logprob_start_len", "stop_regex")},
    "return_text_in_logprobs": None,
}

#: Keys of a ``gen``'s options that only the DSL reads (removed before a backend sees them).
DSL_ONLY_KEYS = ("return_text_in_logprobs",)

#: ``run()`` options that are not sampling options: ``n`` (the default ``n`` of every ``gen``)
#: and SGLang's ``use_thread`` (accepted; sgrt always runs a program's expressions on a worker
#: thread, which gives the same text).
RUN_ONLY_KEYS = ("n", "use_thread")

#: SGLang's sampling temperature when a call sets none (its ``run()`` default); sgrt uses it
#: only for ``gen(n > 1)`` with no temperature anywhere, where greedy decoding would return n
#: identical completions.
SGLANG_DEFAULT_TEMPERATURE = 1.0

#: Options only a ``gen`` may set (one constraint per call); ``run()`` cannot.
CONSTRAINT_KEYS = ("regex", "json_schema", "grammar")

#: SGLang's ``run()`` spells two options differently from its ``gen()``; ported programs may
#: use either name in ``run()``.
RUN_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

#: ``run_batch`` prefix hinting caches the common constant prefix only when it is at least this
#: many characters (shorter prefixes are not worth a request).
MIN_HINTED_PREFIX_CHARS = 64

#: Threads ``run_batch(num_threads="auto")`` uses at most. On one engine more threads only
#: queue requests; the engine's continuous batching does the real parallel work.
AUTO_BATCH_THREADS = 64


def dtype_regex(dtype: Any) -> str:
    """The bounded regex that constrains a ``gen(dtype=...)`` value.

    The regexes live in ``sgrt.constrained.dtypes`` (integers up to 19 digits, strings up to
    ``DEFAULT_STR_MAX_LENGTH`` characters, quoted); imported on first use, so that programs
    without a dtype never load the grammar stack.

    Raises:
        InvalidRequest: (field ``dtype``) not ``int``, ``float``, ``str``, ``bool`` or a name.
    """
    from sgrt.constrained.dtypes import dtype_regex as constrained_dtype_regex

    return constrained_dtype_regex(dtype)


def parse_dtype_value(dtype: Any, text: str) -> Any:
    """The Python value of a ``gen(dtype=...)`` result, or ``None`` if it does not parse
    (the generation was cut short by ``max_tokens``)."""
    from sgrt.constrained.dtypes import parse_dtype_value as constrained_parse

    try:
        return constrained_parse(dtype, text)
    except InvalidRequest:
        return None


def merge_run_options(options: dict[str, Any]) -> dict[str, Any]:
    """Validate the sampling options given to ``run()``: known names, aliases resolved.

    Raises:
        TypeError: an unknown option, or an option and its alias both given.
        InvalidRequest: a ``stop_regex`` that does not compile, a bad ``n``.
    """
    merged: dict[str, Any] = {}
    for key, value in options.items():
        name = RUN_ALIASES.get(key, key)
        if name not in GEN_DEFAULTS and name not in RUN_ONLY_KEYS:
            raise TypeError(f"run() got an unexpected keyword argument {key!r}")
        if name in merged:
            raise TypeError(f"run() got both {key!r} and its alias for {name!r}")
        if value is not None:
            merged[name] = value
    if "stop_regex" in merged:
        merged["stop_regex"] = check_stop_regex(merged["stop_regex"])
    n = merged.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequest(f"n must be an int >= 1, got {n!r}", field="n")
    merged.pop("use_thread", None)
    return merged


def resolve_gen_params(run_options: dict[str, Any], gen_params: dict[str, Any],
                       dtype: Any = None) -> dict[str, Any]:
    """The complete sampling options of one ``gen``: the call's, then ``run()``'s, then defaults.

    ``dtype`` becomes the ``regex`` constraint. Lists are copied, so callers may mutate them.
    """
    params = dict(GEN_DEFAULTS)
    params.update({k: v for k, v in run_options.items() if k not in RUN_ONLY_KEYS})
    params.update(gen_params)
    if dtype is not None:
        params["regex"] = dtype_regex(dtype)
    if isinstance(params["stop_regex"], str):
        params["stop_regex"] = [params["stop_regex"]]
    for key in ("stop", "stop_token_ids", "stop_regex"):
        value = params[key]
        params[key] = [value] if isinstance(value, (str, int)) else list(value or [])
    return params


def gen_sampling_params(run_options: dict[str, Any], gen_params: dict[str, Any], dtype: Any = None,
                        n: int = 1, skip_special_tokens: bool = True,
                        name: str | None = None) -> tuple[SamplingParams, dict[str, Any]]:
    """The DSL's translator: one ``gen``'s :class:`SamplingParams`, built once (so checked
    once) from the call's options, then ``run()``'s, then :data:`GEN_DEFAULTS`, and the
    DSL-only options (:data:`DSL_ONLY_KEYS`) beside it.

    ``n > 1`` with no temperature anywhere samples at :data:`SGLANG_DEFAULT_TEMPERATURE`
    (greedy decoding would give n identical completions), with a ``UserWarning``.
    ``skip_special_tokens=False`` (``global_config.skip_special_tokens_in_output``) applies
    where the call does not set it. ``logprob_start_len`` applies only with ``return_logprob``
    (SGLang's server ignores it otherwise).

    Raises:
        InvalidRequest: a bad or unknown option, named (``SamplingParams``' own check).
    """
    fields = resolve_gen_params(run_options, gen_params, dtype)
    dsl = {k: fields.pop(k) for k in DSL_ONLY_KEYS}
    if not fields["return_logprob"]:
        # NOTE: as in SGLang, logprob_start_len means nothing without return_logprob; passed on,
        # it would score prompt tokens nobody reads (and recompute them past a cached prefix).
        fields["logprob_start_len"] = -1
    if n > 1 and "temperature" not in gen_params and "temperature" not in run_options:
        # NOTE: greedy decoding (sgrt's default) would make the n completions identical;
        # SGLang samples at its run() default here, and so do we, saying so.
        fields["temperature"] = SGLANG_DEFAULT_TEMPERATURE
        warnings.warn(
            f"gen({name!r}, n={n}) sets no temperature: sampling at SGLang's default "
            f"temperature={SGLANG_DEFAULT_TEMPERATURE} (sgrt's greedy default would return "
            f"{n} identical completions); pass temperature=... to choose", UserWarning,
            stacklevel=3)
    if not skip_special_tokens:
        fields.setdefault("skip_special_tokens", False)
    return SamplingParams.from_dict(fields), dsl
