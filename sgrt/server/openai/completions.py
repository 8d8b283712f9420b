"""``POST /v1/completions``: OpenAI text completion requests in (a prompt, a list of prompts, or
token ids), ``n`` engine requests per prompt out, an OpenAI response (or server-sent event
chunks) back; ``echo`` prepends the prompt and its log-probabilities. The field handling lives
in :mod:`sgrt.server.openai.adapter`; the plumbing (auth, limits, aborts) in
:mod:`sgrt.server.http.core`."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from sgrt.engine import StreamChunk
from sgrt.errors import InvalidRequest
from sgrt.server.http.core import EngineCall, HttpApi
from sgrt.server.http.errors import api_error_from, check_result
from sgrt.server.http.streams import SSE_DONE, EventStream, merge_streams, sse
from sgrt.server.openai import adapter as oa
from sgrt.server.openai import protocol as op
from sgrt.server.sglang import fields as sglang_fields


async def completions(api: HttpApi, request: Request) -> Any:
    """``POST /v1/completions``: ``n`` engine requests per prompt (choice ``i * n + j`` is
    choice ``j`` of prompt ``i``); ``echo`` prepends the prompt (and its log-probabilities)."""
    req: op.CompletionRequest = await api.decode(request, op.CompletionRequest)
    if req.suffix:
        raise InvalidRequest("suffix is not supported", field="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of must equal n (or be omitted)", field="best_of")
    oa.check_request_limits(req, api.limits)
    # NOTE: checking, encoding and (for echo) decoding a prompt of up to max_body_bytes of token
    # ids is CPU work: off the event loop, like a chat turn's rendering.
    calls = await api.offload(completion_calls, api, req)
    handles = api.submit(calls, sglang_fields.request_ids(req.rid, len(calls)))
    rid = oa.new_id("cmpl")
    if req.stream:
        primed = await api.prime(request, handles)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _completion_events(api, rid, calls, primed, req, include_usage)
        return EventStream(events, lambda: api.release(handles))
    results = await api.results(request, handles)
    for result in results:
        check_result(result)

    def build() -> op.Completion:  # NOTE: off the loop: echoed prompts' logprobs can be large
        choices = []
        for call, result in zip(calls, results):
            text = result.text
            logprobs = None
            if req.logprobs is not None:
                logprobs = _completion_logprobs(api, result, call, req.echo)
            if req.echo:
                text = call.prompt_text + text
            choices.append(op.CompletionChoice(index=call.index, text=text, logprobs=logprobs,
                                               finish_reason=oa.finish_reason_of(result)))
        firsts = [r for c, r in zip(calls, results) if c.index % req.n == 0]
        return op.Completion(id=rid, created=int(time.time()), model=api.model_name,
                             choices=choices, usage=oa.usage_of(firsts, results))

    return await api.respond(build)


def completion_calls(api: HttpApi, req: op.CompletionRequest) -> list[EngineCall]:
    """The engine calls of a text completion request: ``n`` per prompt (choice ``i * n + j``
    is choice ``j`` of prompt ``i``), prompts encoded (or their token ids checked against the
    vocabulary, and decoded for ``echo``) and fitted to the context window. CPU work: callers run
    it off the event loop.

    Raises:
        InvalidRequest: a bad prompt (naming the item), ``n`` over ``max_n``, a bad field.
        ContextLengthExceeded: a prompt that leaves no room in the context window.
    """
    prompts = completion_prompts(req.prompt, api.info.vocab_size)
    oa.check_n(req.n, len(prompts), api.limits.max_n)
    calls: list[EngineCall] = []
    for p, prompt in enumerate(prompts):
        ids = oa.encode_text(api.tokenizer, prompt, api.bos_id) if isinstance(prompt, str) else prompt
        if not ids:
            raise InvalidRequest("prompt is empty", field="prompt")
        choices = oa.completion_params(req, len(ids), api.context_room(), api.limits)
        ids = api.fit_prompt(ids, choices[0])  # before an echo decodes the whole prompt
        if isinstance(prompt, str):
            text = prompt
        else:
            text = api.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        calls.extend(EngineCall(ids, params, p * req.n + j, p, text) for j, params in enumerate(choices))
    return calls


def _completion_logprobs(api: HttpApi, result: Any, call: EngineCall, echo: bool) -> op.CompletionLogprobs:
    ids = list(result.token_ids)
    lps: list[float | None] = list(result.output_logprobs or [])
    tops = list(result.output_top_logprobs or [])
    if echo:
        prompt_lps = [None] + list(result.prompt_logprobs or [])  # position 0: no context
        prompt_tops = [[]] + list(result.prompt_top_logprobs or [])
        n = len(call.prompt_ids)
        ids = list(call.prompt_ids) + ids
        lps = (prompt_lps + [None] * n)[:n] + lps
        if tops or prompt_tops:
            tops = (prompt_tops + [[]] * n)[:n] + (tops or [[]] * len(result.token_ids))
    return oa.completion_logprobs(ids, lps, tops or None, api.texts)


async def _completion_events(api: HttpApi, rid: str, calls: list[EngineCall], primed: list[tuple[StreamChunk, AsyncIterator]],
                             req: op.CompletionRequest, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    offsets = [0] * len(calls)

    def chunk(choices: list[op.CompletionChoice], usage: op.Usage | None = None) -> bytes:
        return sse(op.Completion(id=rid, created=created, model=api.model_name, choices=choices, usage=usage))

    results: list[Any] = [None] * len(calls)
    try:
        if req.echo:
            for k, call in enumerate(calls):
                offsets[k] = len(call.prompt_text)
                yield chunk([op.CompletionChoice(index=call.index, text=call.prompt_text)])
        async for k, c in merge_streams(primed):
            call = calls[k]
            if c.text or (req.logprobs is not None and c.token_ids):
                logprobs = None
                if req.logprobs is not None:
                    logprobs = oa.completion_logprobs(c.token_ids, list(c.logprobs or []), c.top_logprobs,
                                                      api.texts, offset=offsets[k])
                offsets[k] += len(c.text)
                yield chunk([op.CompletionChoice(index=call.index, text=c.text, logprobs=logprobs)])
            if c.finished:
                results[k] = c.result
                check_result(c.result)
                yield chunk([op.CompletionChoice(index=call.index, text="",
                                                 finish_reason=oa.finish_reason_of(c.result))])
        if include_usage:
            firsts = [r for c, r in zip(calls, results) if c.index % req.n == 0]
            yield chunk([], usage=oa.usage_of(firsts, results))
    except Exception as exc:  # noqa: BLE001 - reported in-stream
        yield sse(op.ErrorResponse(error=api_error_from(exc).info))
    yield SSE_DONE


def completion_prompts(prompt: Any, vocab_size: int | None = None) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, a list of strings, a list of token ids, or a
    list of lists of token ids (each id in ``[0, vocab_size)`` when ``vocab_size`` is given).

    Raises:
        InvalidRequest: (field ``prompt``, or the id's own ``prompt[i]`` / ``prompt[i][j]``)
            anything else, an empty list, or an id outside the vocabulary.
    """
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            check_token_ids(prompt, vocab_size, "prompt")
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            for i, p in enumerate(prompt):
                check_token_ids(p, vocab_size, f"prompt[{i}]")
            return [list(p) for p in prompt]
    raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                         "of token ids (none empty)", field="prompt")


def check_token_ids(ids: list[int], vocab_size: int | None, field: str) -> None:
    """Raise :class:`InvalidRequest` naming ``field[i]`` for the first id outside
    ``[0, vocab_size)`` (nothing when ``vocab_size`` is None). The tokenizer's native decoder
    must never see one."""
    if vocab_size is None or not ids:
        return
    if min(ids) >= 0 and max(ids) < vocab_size:  # NOTE: C-speed scans; the loop only finds which
        return
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {vocab_size}), got {t}", field=f"{field}[{i}]")
