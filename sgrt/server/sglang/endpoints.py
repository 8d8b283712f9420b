"""sgrt's native HTTP endpoints: what the DSL's HTTP backend needs beyond the OpenAI API.

``POST /generate`` (shaped like SGLang's)
    ``text`` or ``input_ids``: one prompt, or a list of them (a batch, answered by a list).
    ``sampling_params``: :class:`sgrt.engine.SamplingParams` fields (``max_new_tokens`` is
    accepted for ``max_tokens``; the engine's defaults apply: greedy, ``max_tokens=128``); one
    dict for all prompts or one per prompt. ``max_tokens=0`` is a prefill-only request: the
    prompt goes into the prefix cache and nothing is generated. SGLang's spellings and fields
    are taken too (``max_new_tokens``, ``min_new_tokens``, ``sampling_seed``, ``no_stop_trim``,
    and the ``GenerateReqInput`` fields an SGLang router adds): honoured, ignored with a
    warning, or refused by name, as :mod:`sgrt.server.sglang.fields` lists. ``return_logprob``,
    ``logprob_start_len`` (an int or one per prompt) and ``top_logprobs_num`` may also be given
    at the top level. ``rid`` names the request(s), for ``/abort_request``. Text prompts are
    encoded as ``/v1/completions`` encodes them (the tokenizer's BOS, if it adds one).

    Answer: ``{"text", "meta_info"}`` where ``meta_info`` has ``id``, ``prompt_tokens``,
    ``completion_tokens``, ``cached_tokens``, ``finish_reason`` (``stop`` / ``length`` /
    ``abort``), ``matched``, ``incomplete``, ``warnings``, ``error``, ``ttft``, ``e2e_latency``
    (seconds), ``forced_tokens``, ``output_token_ids``; with ``return_logprob`` also
    ``output_token_logprobs`` and ``input_token_logprobs`` (lists of ``[logprob, token_id,
    text]``, ``text`` null unless ``return_text_in_logprobs``; the prompt's from
    ``logprob_start_len``, the first ``logprob`` null at position 0) and with
    ``top_logprobs_num`` the matching ``output_top_logprobs`` / ``input_top_logprobs``.

    ``stream: true`` (one prompt): server-sent events ``{"text": <new text>, "token_ids",
    "output_token_logprobs"?, "output_top_logprobs"?, "finished": false}`` and last
    ``{"text", ..., "finished": true, "meta_info"}``, then ``data: [DONE]``. Unlike SGLang's,
    ``text`` is the delta, not the text so far.
``POST /tokenize``
    ``{"prompt": str | [str]}`` or ``{"messages": [...]}`` -> ``{"tokens", "count",
    "max_model_len"}`` (a list of those for a list of prompts), as vLLM answers.
``POST /detokenize``
    ``{"tokens": [...]}`` (at most the model's context window of ids) -> ``{"prompt": text}``
    (special tokens kept).
``POST /apply_chat_template``
    ``{"messages", "add_generation_prompt", "tools"?}`` -> ``{"text"}``.
``POST /flush_cache``
    Drop every unlocked prefix-cache entry -> ``{"ok": true}``.
``POST /abort_request``
    ``{"rid"}``: abort that request (its KV slots are freed) -> ``{"ok": true}``.
``GET /model_info``, ``GET /server_info`` (also SGLang's older ``/get_model_info``,
``/get_server_info``)
    SGLang's keys: ``model_path`` (the served model name), ``tokenizer_path`` (null),
    ``is_generation``, ``has_image_understanding``, ``has_audio_understanding``; the server info
    adds ``served_model_name``, ``tp_size`` and ``dp_size`` (1), ``context_length`` and
    ``version``. An SGLang router reads them to learn which model a worker serves (and lists that
    name in its ``/v1/models``).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from sgrt.engine import Result, SamplingParams
from sgrt.errors import InvalidRequest
from sgrt.server.http.core import NATIVE_ENDPOINTS, HttpApi, EngineCall  # noqa: F401 - re-exported
from sgrt.server.http.errors import ApiError, api_error_from, generation_error, json_response
from sgrt.server.http.streams import SSE_DONE, EventStream, sse
from sgrt.server.limits import check_count, check_stop
from sgrt.server.openai import adapter as oa
from sgrt.server.openai import protocol as op
from sgrt.server.openai.completions import check_token_ids
from sgrt.server.sglang import fields as sglang
from sgrt.server.sglang import protocol as sp


def _batch(req: sp.GenerateRequest, api: HttpApi) -> tuple[list[list[int]], bool]:
    """Prompt ids of every item (token ids checked against the vocabulary) and whether the
    request was a batch (a list). A batch of more than ``max_queue`` prompts could never be
    queued: refused before any is encoded."""
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequest("give exactly one of text and input_ids", field="text")
    limit = api.limits.max_queue
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else list(req.text)
        if not texts:
            raise InvalidRequest("text must not be an empty list", field="text")
        check_count(texts, limit, "max_queue", "text")
        return [oa.encode_text(api.tokenizer, t, api.bos_id) for t in texts], not isinstance(req.text, str)
    ids = req.input_ids
    vocab = api.info.vocab_size
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        check_token_ids(ids, vocab, "input_ids")
        return [list(ids)], False
    if isinstance(ids, list) and ids and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in ids):
        check_count(ids, limit, "max_queue", "input_ids")
        for i, p in enumerate(ids):
            check_token_ids(p, vocab, f"input_ids[{i}]")
        return [list(p) for p in ids], True
    raise InvalidRequest("input_ids must be a non-empty list of token ids or a list of such lists",
                         field="input_ids")


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequest(f"{name} has {len(value)} entries for {n} prompts", field=name)
        return list(value)
    return [value] * n


def generate_params(req: sp.GenerateRequest, n: int, limits: Any = None) -> list[SamplingParams]:
    """The ``/generate`` translator (SGLang's native API): one :class:`SamplingParams` per
    prompt of the ``n`` prompts, from ``sampling_params`` (one object, or one per prompt) and
    the request's logprob fields. ``limits`` (:class:`HttpLimits`): ``default_max_tokens``
    fills an unset max_tokens (else the engine's default) and ``max_tokens_limit`` caps it.

    Raises:
        InvalidRequest: a bad field (``sampling_params.<name>``, ``logprob_start_len``...).
    """
    items = _per_item(req.sampling_params if req.sampling_params is not None else {}, n, "sampling_params")
    starts = _per_item(req.logprob_start_len, n, "logprob_start_len")
    out = []
    for sp, start in zip(items, starts):
        if not isinstance(sp, dict):
            raise InvalidRequest("sampling_params must be an object", field="sampling_params")
        fields = sglang.sampling_fields(sp)
        if limits is not None:
            check_stop(fields.get("stop"), limits.max_stop, limits.max_stop_chars, field="sampling_params.stop")
            stop_ids = fields.get("stop_token_ids")
            if isinstance(stop_ids, list):
                check_count(stop_ids, limits.max_stop_token_ids, "max_stop_token_ids",
                            "sampling_params.stop_token_ids")
            if "max_tokens" not in fields and limits.default_max_tokens is not None:
                fields["max_tokens"] = limits.default_max_tokens
            mt, ceiling = fields.get("max_tokens"), limits.max_tokens_limit
            if ceiling is not None and isinstance(mt, int) and mt > ceiling:
                raise InvalidRequest(f"max_tokens ({mt}) exceeds the server's limit ({ceiling})",
                                     field="sampling_params.max_tokens")
        if req.return_logprob is not None:
            fields["return_logprob"] = req.return_logprob
        if start is not None:
            fields["logprob_start_len"] = start
        if req.top_logprobs_num is not None:
            fields["top_logprobs_num"] = req.top_logprobs_num
        if isinstance(fields.get("json_schema"), str):
            try:
                fields["json_schema"] = json.loads(fields["json_schema"])
            except ValueError as e:
                raise InvalidRequest(f"json_schema is not valid JSON text: {e}",
                                     field="sampling_params.json_schema") from None
        try:
            out.append(SamplingParams.from_dict(fields))
        except InvalidRequest as e:
            raise type(e)(str(e), field=f"sampling_params.{e.field}" if e.field else "sampling_params") from None
    return out


def _triples(api: HttpApi, ids: list[int], lps: list[float | None], with_text: bool) -> list[list[Any]]:
    return [[lp, t, api.texts.text(t) if with_text else None] for lp, t in zip(lps, ids)]


def _tops(api: HttpApi, rows: list[list[tuple[int, float]]], with_text: bool) -> list[list[list[Any]]]:
    return [[[lp, t, api.texts.text(t) if with_text else None] for t, lp in row] for row in rows]


def meta_info(api: HttpApi, result: Result, params: SamplingParams, with_text: bool,
              start: float) -> dict[str, Any]:
    """``meta_info`` of one finished /generate item (see the module docstring)."""
    meta = result.meta_info(time.perf_counter() - start)
    if result.error:  # NOTE: an engine failure's text goes to the log only (generation_error)
        meta["error"] = str(generation_error(result))
    else:
        meta["error"] = None
    if params.return_logprob:
        meta["output_token_logprobs"] = _triples(api, result.token_ids, result.output_logprobs or [], with_text)
        if result.output_top_logprobs:
            meta["output_top_logprobs"] = _tops(api, result.output_top_logprobs, with_text)
    if result.prompt_logprobs is not None:
        start_pos = params.logprob_start_len
        ids = result.prompt_token_ids[start_pos:]
        meta["input_token_logprobs"] = _triples(api, ids, result.prompt_logprobs, with_text)
        if result.prompt_top_logprobs is not None:
            meta["input_top_logprobs"] = _tops(api, result.prompt_top_logprobs, with_text)
    return meta


async def generate(api: HttpApi, request: Request) -> Any:
    # NOTE: no model check: an SGLang router forwards its client's model name, which SGLang's
    # /generate ignores (fields.IGNORED_GENERATE_FIELDS); the OpenAI routes check it.
    req: sp.GenerateRequest = await api.decode(request, sp.GenerateRequest, check_model=False)
    sglang.check_generate_fields({name: getattr(req, name) for name in (
        *sglang.IGNORED_GENERATE_FIELDS, *sglang.REFUSED_GENERATE_FIELDS)})
    prompts, is_batch, params = await api.offload(_prepare, req, api)
    rids = _per_item(req.rid, len(prompts), "rid") if req.rid is not None else None
    if req.stream and is_batch:
        raise InvalidRequest("stream takes one prompt, not a list", field="stream")
    start = time.perf_counter()
    calls = [EngineCall(ids, p, i) for i, (ids, p) in enumerate(zip(prompts, params))]
    handles = api.submit(calls, rids)
    if req.stream:
        primed = await api.prime(request, handles)
        events = _generate_events(api, primed[0], params[0], req.return_text_in_logprobs, start)
        return EventStream(events, lambda: api.release(handles))
    results = await api.results(request, handles)

    def build() -> Any:  # NOTE: off the loop: a long prompt's logprobs are many entries
        out = [{"text": r.text, "meta_info": meta_info(api, r, p, req.return_text_in_logprobs, start)}
               for r, p in zip(results, params)]
        return out if is_batch else out[0]

    return await api.respond(build)


def _prepare(req: sp.GenerateRequest, api: HttpApi) -> tuple[list[list[int]], bool, list[SamplingParams]]:
    """Prompts (encoded, or checked), whether it was a batch, and their params; CPU work run
    off the event loop."""
    prompts, is_batch = _batch(req, api)
    return prompts, is_batch, generate_params(req, len(prompts), api.limits)


async def _generate_events(api: HttpApi, primed: tuple[Any, AsyncIterator], params: SamplingParams,
                           with_text: bool, start: float) -> AsyncIterator[bytes]:
    first, it = primed
    try:
        chunk = first
        while True:
            event: dict[str, Any] = {"text": chunk.text, "token_ids": list(chunk.token_ids),
                                     "finished": chunk.finished}
            if chunk.logprobs is not None:
                event["output_token_logprobs"] = _triples(api, chunk.token_ids, chunk.logprobs, with_text)
            if chunk.top_logprobs:
                event["output_top_logprobs"] = _tops(api, chunk.top_logprobs, with_text)
            if chunk.finished:
                event["meta_info"] = meta_info(api, chunk.result, params, with_text, start)
            yield sse(event)
            if chunk.finished:
                break
            chunk = await it.__anext__()
    except Exception as exc:  # noqa: BLE001 - reported in-stream
        yield sse(op.ErrorResponse(error=api_error_from(exc).info))
    yield SSE_DONE


async def tokenize(api: HttpApi, request: Request) -> Any:
    req: sp.TokenizeRequest = await api.decode(request, sp.TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", field="prompt")
    limit = api.info.context_length

    def one(ids: list[int]) -> dict[str, Any]:
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    if req.messages is not None:
        check_count(req.messages, api.limits.max_messages, "max_messages", "messages")
        return await api.respond(lambda: one(api.tokenizer.encode(api.renderer.render(req.messages, oa.ToolPlan()))))
    encode = (lambda t: oa.encode_text(api.tokenizer, t, api.bos_id)) if req.add_special_tokens else \
        (lambda t: api.tokenizer.encode(t))
    if isinstance(req.prompt, str):
        return await api.respond(lambda: one(encode(req.prompt)))
    return await api.respond(lambda: [one(encode(p)) for p in req.prompt])


async def detokenize(api: HttpApi, request: Request) -> Any:
    req: sp.DetokenizeRequest = await api.decode(request, sp.DetokenizeRequest)
    # NOTE: the tokenizer's native decode holds the GIL for the whole call (~0.1 s per 500k ids),
    # which no worker thread hides from the event loop: at most a context window of ids.
    window = api.info.context_length
    if len(req.tokens) > window:
        raise InvalidRequest(f"tokens has {len(req.tokens)} ids; the limit is the model's context window ({window})",
                             field="tokens")

    def run() -> dict[str, Any]:  # NOTE: off the loop all the same (the range check is Python)
        check_token_ids(req.tokens, api.info.vocab_size, "tokens")
        return {"prompt": api.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return await api.respond(run)


async def apply_chat_template(api: HttpApi, request: Request) -> Any:
    req: sp.ChatTemplateRequest = await api.decode(request, sp.ChatTemplateRequest)
    check_count(req.messages, api.limits.max_messages, "max_messages", "messages")
    check_count(req.tools, api.limits.max_tools, "max_tools", "tools")
    kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt}
    if req.tools is not None:
        kwargs["tools"] = req.tools

    def render() -> dict[str, Any]:  # NOTE: off the loop: rendering is Python (Jinja) per message
        try:
            return {"text": api.tokenizer.apply_chat_template(req.messages, **kwargs)}
        except InvalidRequest as e:
            no_template = "no chat template" in str(e)
            raise ApiError(400, str(e), param="chat_template" if no_template else e.field,
                           code="no_chat_template" if no_template else "invalid_value") from None
        except Exception as e:  # noqa: BLE001 - a template error is the caller's messages
            raise InvalidRequest(f"the chat template failed on these messages: {e}", field="messages") from None

    return await api.respond(render)


async def flush_cache(api: HttpApi, request: Request) -> Any:
    await api.request_body(request)  # Origin, auth, Content-Type (a body, if any, is ignored)
    api.check_available()
    await asyncio.to_thread(api.engine.flush_cache)
    return json_response({"ok": True})


async def abort_request(api: HttpApi, request: Request) -> Any:
    req: sp.AbortRequest = await api.decode(request, sp.AbortRequest)
    api.engine.abort(req.rid)
    return json_response({"ok": True})


def _model_info(api: HttpApi) -> dict[str, Any]:
    return {"model_path": api.model_name, "tokenizer_path": None, "is_generation": True,
            "has_image_understanding": False, "has_audio_understanding": False}


async def model_info(api: HttpApi, request: Request) -> Any:
    api.check_auth(request)
    return json_response(_model_info(api))


async def server_info(api: HttpApi, request: Request) -> Any:
    import sgrt

    api.check_auth(request)
    return json_response({**_model_info(api), "served_model_name": api.model_name, "tp_size": 1, "dp_size": 1,
                          "context_length": api.info.context_length, "version": sgrt.__version__})
