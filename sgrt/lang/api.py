"""The DSL's public functions: ``gen``, ``select``, roles, ``@function``, the default backend.

Names and parameters follow SGLang's frontend language, so that its programs port by changing
the import. Differences on purpose: ``gen`` samples greedily unless given a temperature
(``sgrt.lang.defaults``); ``regex`` together with ``dtype`` is an error; a ``str`` dtype is
bounded; ``choices`` cannot be combined with sampling options.
"""
from __future__ import annotations

import threading
from typing import Any

from sgrt.errors import InvalidRequest
from sgrt.lang import ir
from sgrt.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sgrt.lang.defaults import dtype_regex

_default_backend: Any = None
_default_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """Make ``backend`` (e.g. ``sgrt.Runtime(model=...)``) the one programs use by default."""
    global _default_backend
    with _default_lock:
        _default_backend = backend


def get_default_backend() -> Any:
    """The backend set by :func:`set_default_backend`, or ``None``."""
    return _default_backend


def _resolve_backend(backend: Any) -> Any:
    backend = backend if backend is not None else _default_backend
    if backend is None:
        raise InvalidRequest(
            "no backend: pass backend=... or call sgrt.set_default_backend(sgrt.Runtime(...))",
            field="backend")
    return backend


def flush_cache(backend: Any = None) -> None:
    """Empty the prefix cache of ``backend`` (default: the default backend)."""
    _resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    """Model and engine facts from ``backend`` (default: the default backend)."""
    return _resolve_backend(backend).get_server_info()


# ---- gen / select ---------------------------------------------------------------------------

def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    seed: int | None = None,
    dtype: Any = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    grammar: str | None = None,
) -> ir.Expr:
    """Generate text into variable ``name``.

    Every option left ``None`` is inherited from ``run()``, then from
    ``sgrt.lang.defaults.GEN_DEFAULTS`` (greedy, ``max_tokens=128``). ``stop`` strings are not
    part of the output. At most one constraint: ``regex``, ``json_schema``, ``grammar`` or
    ``dtype`` (``int``, ``float``, ``str``, ``bool``: a bounded regex from
    ``sgrt.constrained.dtypes``; the variable holds the text, as in SGLang, and the meta info's
    ``"value"`` the parsed value, or ``None`` if the generation was cut short). ``n > 1`` samples n
    completions (the variable is their list; the first is appended to the text).
    ``choices=[...]`` makes this a :func:`select`.

    Raises:
        InvalidRequest: ``dtype`` with ``regex`` (or another constraint), ``choices`` with
            sampling options, a bad ``n``.
        TypeError: an unknown keyword.
    """
    params = {
        "max_tokens": max_tokens, "min_tokens": min_tokens, "stop": stop,
        "stop_token_ids": stop_token_ids, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "min_p": min_p, "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty, "ignore_eos": ignore_eos,
        "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num, "seed": seed, "regex": regex,
        "json_schema": json_schema, "grammar": grammar,
    }
    params = {k: v for k, v in params.items() if v is not None}
    if choices is not None:
        extra = sorted(k for k in params if k != "temperature") + (["n"] if n is not None else [])
        extra += ["dtype"] if dtype is not None else []
        if extra:
            raise InvalidRequest(
                f"gen(choices=...) is a select and takes no {', '.join(extra)}",
                field=extra[0])
        return select(name, choices, temperature=temperature or 0.0,
                      choices_method=choices_method)
    if choices_method is not None:
        raise InvalidRequest("choices_method needs choices", field="choices_method")
    constraints = [k for k in ("regex", "json_schema", "grammar") if k in params]
    if dtype is not None:
        dtype_regex(dtype)  # validate now
        if constraints:
            raise InvalidRequest(
                f"gen() takes dtype or {constraints[0]}, not both "
                "(dtype is itself a regex constraint)", field="dtype")
    if len(constraints) > 1:
        raise InvalidRequest(f"gen() takes one constraint, got {', '.join(constraints)}",
                             field=constraints[1])
    # NOTE: regex, json_schema and grammar are compiled by the engine (sgrt.constrained), whose
    # regex dialect is not Python's; a constraint it refuses surfaces as GrammarError from the
    # program's readers (s["x"], s.text()).
    if isinstance(stop, str):
        params["stop"] = [stop]
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequest(f"n must be an int >= 1, got {n!r}", field="n")
    return ir.Gen(name, params, dtype, n)


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    seed: int | None = None,
) -> ir.Expr:
    """``gen(..., dtype=int)``: an integer (bounded number of digits)."""
    return gen(name, max_tokens=max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
               temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
               ignore_eos=ignore_eos, return_logprob=return_logprob,
               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
               seed=seed, dtype=int)


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    seed: int | None = None,
) -> ir.Expr:
    """``gen(..., dtype=str)``: a double-quoted string of bounded length."""
    return gen(name, max_tokens=max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
               temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
               ignore_eos=ignore_eos, return_logprob=return_logprob,
               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
               seed=seed, dtype=str)


def select(name: str | None = None, choices: list[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod | None = None) -> ir.Expr:
    """Choose one of ``choices`` into variable ``name`` by their log-probabilities.

    The text so far is prefilled once, then every option is scored by its own tokens in one
    batch; ``choices_method`` (default ``token_length_normalized``) decides. The meta info
    holds the per-option scores. ``temperature`` exists for SGLang compatibility and must be 0.

    Raises:
        InvalidRequest: no choices, an empty or non-str option, a non-zero temperature.
    """
    if not choices:
        raise InvalidRequest("select needs a non-empty list of choices", field="choices")
    choices = list(choices)
    for c in choices:
        if not isinstance(c, str) or not c:
            raise InvalidRequest(f"select choices must be non-empty strings, got {c!r}",
                                 field="choices")
    if temperature:
        raise InvalidRequest("select decides by log-probabilities; temperature must be 0",
                             field="temperature")
    if choices_method is not None and not callable(choices_method):
        raise InvalidRequest("choices_method must be a ChoicesSamplingMethod",
                             field="choices_method")
    return ir.Select(name, choices, choices_method or token_length_normalized)


# ---- roles ----------------------------------------------------------------------------------

def _role(role: str, expr: Any) -> ir.Expr:
    if expr is None:
        return ir.ExprList([ir.RoleBegin(role), ir.RoleEnd(role)])
    return ir.RoleBegin(role) + ir.to_expr(expr) + ir.RoleEnd(role)


def system(expr: Any = None) -> ir.Expr:
    """A system message holding ``expr``."""
    return _role("system", expr)


def user(expr: Any = None) -> ir.Expr:
    """A user message holding ``expr``."""
    return _role("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    """An assistant message holding ``expr`` (usually a ``gen``)."""
    return _role("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")
