"""The DSL's public functions: ``gen``, ``select``, roles, ``@function``, the default backend.

Names and parameters follow SGLang's frontend language (``sglang.lang.api``), so that its
programs port by changing the import. Deliberate differences (each documented where it lives):

- ``gen`` decodes greedily unless a temperature is given (SGLang's ``run()`` defaults to 1.0,
  so an unset temperature samples there); with ``n > 1`` and no temperature anywhere, that call
  samples at SGLang's 1.0 and warns naming ``temperature`` (``sgrt.lang.defaults``).
- ``regex`` together with ``dtype`` is an error (SGLang warns and drops the regex); a ``str``
  dtype is bounded in length; ``dtype`` adds no stop strings; ``choices`` cannot be combined
  with sampling options.
- the chat template's end-of-turn string is not added to a ``gen``'s stops (the engine stops at
  the end-of-turn token itself, and the text is the same).
- log-probability entries ``(logprob, token_id, text)`` carry the token text unless
  ``return_text_in_logprobs=False`` is given (SGLang gives ``None`` unless it is True).
- ``stop_regex`` keeps the text that matched (as SGLang's server returns it) and stops at the end
  of the match.
- a gen that ends because its constraint is complete reports ``finish_reason`` ``{"type":
  "stop", "matched": "grammar"}`` (SGLang's ``matched`` is then the last token's id, which a
  program cannot tell from an EOS or stop id): the program learns that the value is whole.
- ``@function(num_api_spec_tokens=...)`` is accepted and has no effect: API speculative
  execution saves black-box API calls; sgrt's backends keep the KV cache between ``gen`` calls,
  so each ``gen`` is already one incremental request, and the output is the one without it.
- ``s.fork(n, position_ids_offset)``: the offsets are accepted and must be ``None`` or one int
  per branch; they have no effect (SGLang's interpreter ignores them too).
- ``image`` / ``video`` raise ``InvalidRequest`` when executed: the models sgrt loads have no
  vision tower.
- ``flush_cache(empty_cache=True)`` also returns the accelerator's cached memory to the driver
  when the engine runs on CUDA; on the CPU there is nothing to return.
- ``compile()`` returns the interpreted program (sgrt's interpreter already runs a program
  ahead of its generations and overlaps forks, which is what SGLang's compiled mode added).
- ``run(use_thread=...)`` is accepted and has no effect: a program's expressions always run on
  a worker thread (same text either way).
- ``sgrt.Runtime`` is the in-process engine (SGLang's launches a server): ``runtime.endpoint``
  is the runtime itself, ``runtime.url`` starts an HTTP server over the same engine on first
  use, and ``runtime.generate(prompt, params)`` is the DSL backend's call, not SGLang's
  JSON-returning helper.
- ``separate_reasoning`` also splits when streaming (after the gen ends; the streamed pieces
  still hold the reasoning), where SGLang skips it.
- ``trace()`` records f-strings over arguments and generated variables as references to them
  (SGLang's tracer raises ``TypeError`` for an argument and writes a variable's repr into the
  text), so the traced graph and constant prefix are those of the program ``run()`` runs.
"""
from __future__ import annotations

from typing import Any

from sgrt.errors import InvalidRequest
from sgrt.global_config import global_config
from sgrt.lang import ir
from sgrt.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sgrt.lang.defaults import check_stop_regex, dtype_regex  # noqa: F401 - re-exported


def set_default_backend(backend: Any) -> None:
    """Make ``backend`` (e.g. ``sgrt.Runtime(model=...)``) the one programs use by default
    (``sgrt.global_config.default_backend``)."""
    global_config.default_backend = backend


def get_default_backend() -> Any:
    """The backend set by :func:`set_default_backend`, or ``None``."""
    return global_config.default_backend


def _resolve_backend(backend: Any) -> Any:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise InvalidRequest(
            "no backend: pass backend=... or call sgrt.set_default_backend(sgrt.Runtime(...))",
            field="backend")
    return backend


def flush_cache(backend: Any = None, empty_cache: bool = True) -> Any:
    """Empty the prefix cache of ``backend`` (default: the default backend).

    ``empty_cache`` (SGLang's flag) also releases the accelerator's cached memory when the
    engine runs on CUDA (no effect on the CPU). As in SGLang, returns ``False`` when there is
    no backend at all.
    """
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return False
    return backend.flush_cache(empty_cache=empty_cache)


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """Model and engine facts from ``backend`` (default: the default backend), with the keys
    SGLang's ``/get_server_info`` gives programs (``model_path``, ``tokenizer_path``,
    ``context_length``, ``max_total_num_tokens``, ``version``...). ``None`` without a backend,
    as in SGLang."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return None
    return backend.get_server_info()


# ---- gen / select ---------------------------------------------------------------------------

def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
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
    return_text_in_logprobs: bool | None = None,
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
    completions (the variable is their list; the first is appended to the text); with no
    temperature given anywhere such a call samples at SGLang's default 1.0, with a warning.
    ``choices=[...]`` makes this a :func:`select`.

    The meta info (``s.get_meta_info(name)``) is shaped as SGLang's (``sgrt.lang.meta_info``):
    ``finish_reason`` is ``{"type": "stop", "matched": ...}`` or ``{"type": "length",
    "length": n}``; with ``return_logprob`` it has ``output_token_logprobs`` and
    ``input_token_logprobs`` (the prompt's tokens from ``logprob_start_len`` on, the first
    prompt token's log-probability ``None``; ``[]`` without ``logprob_start_len``), entries
    ``(logprob, token_id, text)``, and with ``top_logprobs_num`` the matching ``*_top_logprobs``.

    ``stop_regex`` (a Python regex or a list of them, SGLang's parameter) ends the generation as
    soon as the generated text contains a match; the text ends at the end of that match
    (``finish_reason`` ``{"type": "stop", "matched": <the pattern>}``).
    ``return_text_in_logprobs``: the token text in each log-probability entry (default:
    included; ``False``: ``None`` as in SGLang). ``max_tokens=0`` with ``return_logprob`` and
    ``top_logprobs_num=k`` gives, in ``output_top_logprobs[0]``, the k most likely next tokens
    after the prompt (SGLang's CoT decoding idiom) and generates nothing.

    Raises:
        InvalidRequest: ``dtype`` with ``regex`` (or another constraint), ``choices`` with
            sampling options, a bad ``n``, a ``stop_regex`` that does not compile.
        TypeError: an unknown keyword.
    """
    params = {
        "max_tokens": max_tokens, "min_tokens": min_tokens, "stop": stop,
        "stop_token_ids": stop_token_ids, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "min_p": min_p, "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty, "ignore_eos": ignore_eos,
        "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num, "seed": seed, "regex": regex,
        "json_schema": json_schema, "grammar": grammar, "stop_regex": stop_regex,
        "return_text_in_logprobs": return_text_in_logprobs,
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
    if stop_regex is not None:
        params["stop_regex"] = check_stop_regex(stop_regex)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InvalidRequest(f"n must be an int >= 1, got {n!r}", field="n")
    return ir.Gen(name, params, dtype, n)


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
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
    return_text_in_logprobs: bool | None = None,
    seed: int | None = None,
) -> ir.Expr:
    """``gen(..., dtype=int)``: an integer (bounded number of digits)."""
    return gen(name, max_tokens=max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
               stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
               ignore_eos=ignore_eos, return_logprob=return_logprob,
               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
               return_text_in_logprobs=return_text_in_logprobs, seed=seed, dtype=int)


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
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
    return_text_in_logprobs: bool | None = None,
    seed: int | None = None,
) -> ir.Expr:
    """``gen(..., dtype=str)``: a double-quoted string of bounded length."""
    return gen(name, max_tokens=max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
               stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
               ignore_eos=ignore_eos, return_logprob=return_logprob,
               logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
               return_text_in_logprobs=return_text_in_logprobs, seed=seed, dtype=str)


def select(name: str | None = None, choices: list[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod | None = None) -> ir.Expr:
    """Choose one of ``choices`` into variable ``name`` by their log-probabilities.

    The text so far is prefilled once, then every option is scored by its own tokens in one
    batch; ``choices_method`` (default ``token_length_normalized``; any
    ``ChoicesSamplingMethod`` written to SGLang's call signature) decides. The meta info has
    SGLang's keys, per option: ``normalized_prompt_logprobs``, ``input_token_logprobs``
    (``(logprob, token_id, text)`` of the option's tokens), ``output_token_logprobs`` (``[]``),
    and whatever the method adds (``greedy_logprob_matrix``; ``unconditional_token_logprobs``
    and ``normalized_unconditional_prompt_logprobs``); sgrt adds ``choices``, ``decision``,
    ``prompt_tokens`` and ``cached_tokens``. ``temperature`` exists for SGLang compatibility
    and must be 0.

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


# ---- multimodal and reasoning ---------------------------------------------------------------

def image(expr: Any) -> ir.Expr:
    """An image input (SGLang's ``sgl.image(path)``).

    Executing it raises ``InvalidRequest`` (field ``image``) naming the primitive: the models sgrt
    loads have no vision tower, so there is nothing to give the image to.
    """
    return ir.Image(expr)


def video(path: Any, num_frames: int) -> ir.Expr:
    """A video input (SGLang's ``sgl.video(path, num_frames)``); executing it raises
    ``InvalidRequest`` (field ``video``) like :func:`image`."""
    return ir.Video(path, num_frames)


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ir.Expr:
    """Run ``expr`` (usually a ``gen``), then split a thinking model's reasoning off its answer.

    SGLang's semantics: for each named ``gen`` / ``select`` ``x`` in ``expr``, ``s["x"]`` keeps
    the answer, ``s["x_reasoning_content"]`` gets the reasoning (``<think>...</think>`` or the
    family's tags, see ``sgrt.lang.reasoning``), and the text of the open message becomes the
    answer alone. Whitespace is stripped as SGLang's parser strips it: ``"<think> abc </think>
    Four"`` gives reasoning ``"abc "`` and answer ``"Four"``. ``model_type`` is SGLang's reasoning-parser name (``"deepseek-r1"``,
    ``"qwen3"``...; ``None``: plain ``<think>`` tags).

    Raises:
        InvalidRequest: an unknown ``model_type``; ``expr`` is ``None``.
    """
    from sgrt.lang.reasoning import reasoning_format

    reasoning_format(model_type)  # validate now
    if expr is None:
        raise InvalidRequest("separate_reasoning needs an expression (a gen)", field="expr")
    inner = ir.to_expr(expr)
    return ir.ExprList([inner, ir.SeparateReasoning(model_type, inner)])
