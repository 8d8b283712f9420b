"""The OpenAI-compatible APIs' translator to :class:`~sgrt.sampling_params.SamplingParams` (chat
and text completions; the Responses and Anthropic adapters reuse it): the request's sampling
fields and constraints (``response_format``, SGLang's and vLLM's extras) as ``SamplingParams``
fields (:func:`sampling_fields`), then the one build (:func:`build_params`) whose errors name the
request's own field, and ``max_tokens`` resolved against the context window."""
from __future__ import annotations

import json
from typing import Any

from sgrt.errors import ContextLengthExceeded, InvalidRequest
from sgrt.sampling_params import SamplingParams
from sgrt.server.limits import check_count, check_stop
from sgrt.server.openai import protocol as op
from sgrt.server.sglang import fields as sglang_fields

#: ``SamplingParams`` field -> request field, where the names differ (for 400s that name the
#: field the client sent).
CHAT_FIELD_NAMES = {"top_logprobs_num": "top_logprobs", "return_logprob": "logprobs"}
COMPLETION_FIELD_NAMES = {"top_logprobs_num": "logprobs", "return_logprob": "logprobs"}


# ==== sampling ====================================================================================


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def check_request_limits(req: Any, limits: Any) -> None:
    """Bound what a chat or text completion request makes the server do per token or per
    message, before any of it is used: ``stop`` (``max_stop`` strings, ``max_stop_chars``
    characters), ``stop_token_ids`` (``max_stop_token_ids``), ``logit_bias``
    (``max_logit_bias``), ``messages`` (``max_messages``) and ``tools`` (``max_tools``).

    Raises:
        InvalidRequest: naming the field and the limit.
    """
    check_stop(req.stop, limits.max_stop, limits.max_stop_chars)
    check_count(req.stop_token_ids, limits.max_stop_token_ids, "max_stop_token_ids", "stop_token_ids")
    check_count(req.logit_bias, limits.max_logit_bias, "max_logit_bias", "logit_bias")
    check_count(getattr(req, "messages", None), limits.max_messages, "max_messages", "messages")
    check_count(getattr(req, "tools", None), limits.max_tools, "max_tools", "tools")


def sampling_fields(req: op.SamplingFields) -> dict[str, Any]:
    """The ``SamplingParams`` fields common to chat and text completions (OpenAI defaults:
    temperature 1, top_p 1), constraints included; ``max_tokens`` and logprobs are added by the
    caller.

    Raises:
        InvalidRequest: unsupported ``logit_bias``, a bad ``response_format``, or
            ``response_format`` beside a constraint field (two constraint fields are refused
            when the params are built, by :class:`SamplingParams`).
    """
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", field="logit_bias")
    out: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "stop": _stop_list(req.stop),
        "seed": req.seed,
    }
    optional = {
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "min_tokens": req.min_tokens,
        "repetition_penalty": req.repetition_penalty,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    out.update(sglang_fields.completion_fields(req.no_stop_trim, req.ebnf, req.return_hidden_states))
    constraints = {k: v for k, v in (("regex", req.regex), ("json_schema", req.json_schema),
                                     ("grammar", req.grammar)) if v is not None}
    fmt = response_format_schema(req.response_format)
    if fmt is not None:
        if constraints:
            name = next(iter(constraints))
            raise InvalidRequest(f"set either response_format or {name}, not both", field="response_format")
        constraints["json_schema"] = fmt
    if "json_schema" in constraints and isinstance(constraints["json_schema"], str):
        try:
            constraints["json_schema"] = json.loads(constraints["json_schema"])
        except ValueError as e:
            raise InvalidRequest(f"json_schema is not valid JSON text: {e}", field="json_schema") from None
    out.update(constraints)
    return out


def response_format_schema(fmt: op.ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON Schema a ``response_format`` asks for (None for ``text`` or no format).

    Raises:
        InvalidRequest: an unknown type, or ``json_schema`` without its object.
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest("response_format of type json_schema needs a json_schema object",
                                 field="response_format.json_schema")
        schema = fmt.json_schema.schema
        return {"type": "object"} if schema is None else schema
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}",
                         field="response_format.type")


def build_params(fields: dict[str, Any], field_names: dict[str, str], choice: int = 0) -> SamplingParams:
    """The OpenAI-compatible APIs' translator (chat, text completions, Responses, Anthropic
    messages): choice ``choice``'s :class:`SamplingParams` from :func:`sampling_fields` (and the
    fields the caller added), built so checked once; ``seed + choice``, so that n choices with
    one seed differ, reproducibly. An ``InvalidRequest`` names the request's own field
    (``field_names``: ``SamplingParams`` name -> request name where they differ).
    """
    if choice and fields.get("seed") is not None:
        fields = {**fields, "seed": fields["seed"] + choice}
    try:
        return SamplingParams.from_dict(fields)
    except InvalidRequest as e:
        name = field_names.get(e.field or "", e.field)
        raise type(e)(str(e), field=name) from None


def check_n(n: Any, prompts: int, max_n: int) -> None:
    """``n`` (choices per prompt) is an int >= 1 and ``n * prompts`` within ``max_n``: the one
    check of OpenAI's ``n`` (chat and text completions).

    Raises:
        InvalidRequest: field ``n``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequest(f"n must be an int >= 1, got {n!r}", field="n")
    if n * prompts > max_n:
        raise InvalidRequest(f"n ({n}) x prompts ({prompts}) exceeds the server's limit ({max_n} choices)", field="n")


def chat_params(req: op.ChatCompletionRequest, plan: Any, prompt_len: int, room: int, limits: Any,
                field_names: dict[str, str] = CHAT_FIELD_NAMES) -> list[SamplingParams]:
    """The chat completions translator (also the Responses and Messages APIs', through their
    translated chat request): the ``n`` choices' :class:`SamplingParams` of ``req`` (OpenAI's
    ``POST /v1/chat/completions`` fields), with the turn grammar of ``plan`` (a
    :class:`~sgrt.server.turns.plan.ToolPlan`, finished here), ``max_tokens`` resolved
    against ``room`` (tokens one request may hold) for a prompt of ``prompt_len`` tokens, and
    ``limits`` (:class:`~sgrt.server.limits.HttpLimits`).

    Raises:
        InvalidRequest: a bad field, named as the client sent it (``field_names``: SamplingParams
            name -> request name), ``n`` over ``max_n``.
        ContextLengthExceeded: the prompt leaves no room for an answer.
    """
    check_n(req.n, 1, limits.max_n)
    fields = sampling_fields(req)
    plan.finish(fields)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    fields["max_tokens"] = resolve_max_tokens(
        requested, prompt_len, room, default=limits.default_max_tokens, ceiling=limits.max_tokens_limit,
        field=name)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", field="top_logprobs")
    fields["return_logprob"] = bool(req.logprobs)
    fields["top_logprobs_num"] = req.top_logprobs or 0
    return [build_params(fields, field_names, i) for i in range(req.n)]


def completion_params(req: op.CompletionRequest, prompt_len: int, room: int, limits: Any) -> list[SamplingParams]:
    """The text completions translator: the ``n`` choices' :class:`SamplingParams` of one
    prompt of ``prompt_len`` tokens (OpenAI's ``POST /v1/completions`` fields; ``logprobs``
    and ``echo`` included), ``max_tokens`` resolved against ``room``. ``n`` itself is checked
    against the prompt count by the caller (:func:`check_n`).

    Raises:
        InvalidRequest: a bad field (named as the client sent it).
        ContextLengthExceeded: the prompt leaves no room for an answer.
    """
    fields = sampling_fields(req)
    if req.logprobs is not None:
        fields["return_logprob"] = True
        fields["top_logprobs_num"] = req.logprobs
    if req.echo and req.logprobs is not None:
        # NOTE: from position 1: position 0 has no log-probability anyway, and a start of 0
        # misses a radix-cache hit's positions in the engine (see _completion_logprobs).
        fields["logprob_start_len"] = 1
    fields["max_tokens"] = resolve_max_tokens(
        req.max_tokens, prompt_len, room, default=limits.default_max_tokens, ceiling=limits.max_tokens_limit,
        field="max_tokens")
    return [build_params(fields, COMPLETION_FIELD_NAMES, j) for j in range(req.n)]


def resolve_max_tokens(requested: int | None, prompt_len: int, context_len: int, *,
                       default: int | None, ceiling: int | None, field: str) -> int:
    """``max_tokens`` for one request: the client's, else ``default``, else the rest of the
    context window (OpenAI's behaviour). ``context_len`` is the smaller of the model's window
    and the KV pool.

    Raises:
        InvalidRequest: over ``ceiling`` (the server's limit) or negative (field ``field``).
        ContextLengthExceeded: the prompt leaves no room (field ``messages`` / ``prompt``).
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
            raise InvalidRequest(f"{field} must be an int >= 0, got {requested!r}", field=field)
        if ceiling is not None and requested > ceiling:
            raise InvalidRequest(f"{field} ({requested}) exceeds the server's limit ({ceiling})", field=field)
        return requested
    room = context_len - prompt_len
    if room <= 0:
        raise ContextLengthExceeded(
            f"the prompt ({prompt_len} tokens) fills the context window ({context_len} tokens)",
            field="prompt")
    value = room if default is None else min(default, room)
    return value if ceiling is None else min(value, ceiling)
