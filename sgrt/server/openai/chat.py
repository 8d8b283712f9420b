"""``POST /v1/chat/completions``: an OpenAI chat request in, ``n`` engine requests out (one turn
each, planned and read back by :mod:`sgrt.server.openai.chat_turns`), an OpenAI response (or
server-sent event chunks) back. The field handling lives in :mod:`sgrt.server.openai.adapter`;
the plumbing (auth, limits, aborts) in :mod:`sgrt.server.http.core`."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from sgrt.engine import StreamChunk
from sgrt.server.http.core import EngineCall, HttpApi
from sgrt.server.http.errors import api_error_from, check_result
from sgrt.server.http.streams import SSE_DONE, EventStream, sse
from sgrt.server.openai import adapter as oa
from sgrt.server.openai import chat_turns as ct
from sgrt.server.openai import protocol as op
from sgrt.server.sglang import fields as sglang_fields


async def chat_completions(api: HttpApi, request: Request) -> Any:
    """``POST /v1/chat/completions``: ``n`` engine requests over the rendered messages; a JSON
    answer, or an :class:`EventStream` of ``chat.completion.chunk`` events (tool calls streamed
    incrementally: id and name first, then argument fragments)."""
    req: op.ChatCompletionRequest = await api.decode(request, op.ChatCompletionRequest)
    turn = await api.offload(ct.prepare_turn, api, req)  # NOTE: rendering and tokenizing off the loop
    plan = turn.plan
    calls = [EngineCall(turn.prompt_ids, params, i) for i, params in enumerate(turn.params)]
    handles = api.submit(calls, sglang_fields.request_ids(req.rid, len(calls)))
    rid = oa.new_id("chatcmpl")
    if req.stream:
        primed = await api.prime(request, handles)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _chat_events(api, rid, primed, plan, include_usage, bool(req.logprobs))
        return EventStream(events, lambda: api.release(handles))
    results = await api.results(request, handles)
    for result in results:
        check_result(result)

    def build() -> op.ChatCompletion:  # NOTE: off the loop: n choices of logprobs can be large
        choices = []
        for i, result in enumerate(results):
            out = oa.read_turn(result.text, plan, result.finish_reason)
            message = op.ResponseMessage(content=out.content, reasoning_content=out.reasoning, tool_calls=out.calls)
            logprobs = None
            if req.logprobs and not out.calls:
                logprobs = oa.chat_logprobs(result.token_ids, result.output_logprobs,
                                            result.output_top_logprobs, api.texts)
            choices.append(op.ChatChoice(index=i, message=message, logprobs=logprobs,
                                         finish_reason=oa.finish_reason_of(result, bool(out.calls))))
        return op.ChatCompletion(id=rid, created=int(time.time()), model=api.model_name,
                                 choices=choices, usage=oa.usage_of(results[:1], results))

    return await api.respond(build)


async def _chat_events(api: HttpApi, rid: str, primed: list[tuple[StreamChunk, AsyncIterator]], plan: oa.ToolPlan,
                       include_usage: bool, want_logprobs: bool) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(choices: list[op.ChatChunkChoice], usage: op.Usage | None = None) -> bytes:
        return sse(op.ChatCompletionChunk(id=rid, created=created, model=api.model_name, choices=choices,
                                          usage=usage))

    # NOTE: the role chunk says content null when the turn is tool calls and "" when text, as
    # OpenAI's do; a turn that may be either sends it with its first increment.
    started = [False] * len(primed)
    if plan.mode in ("required", "named") or not plan.may_call:
        for i in range(len(primed)):
            started[i] = True
            content = None if plan.may_call else ""
            yield chunk([op.ChatChunkChoice(index=i, delta=op.Delta(role="assistant", content=content))])
    results: list[Any] = [None] * len(primed)
    pending_text: list[str] = [""] * len(primed)
    called = [False] * len(primed)
    try:
        async for ev in ct.turn_events(primed, plan):
            i = ev.choice
            if not started[i] and (ev.kind in ("text", "reasoning", "call", "done")
                                   or (ev.kind == "logprobs" and want_logprobs)):
                started[i] = True
                content = None if ev.kind == "call" or (ev.kind == "done" and ev.output.calls) else ""
                yield chunk([op.ChatChunkChoice(index=i, delta=op.Delta(role="assistant", content=content))])
            if ev.kind == "text":
                pending_text[i] += ev.text
                if not want_logprobs:
                    yield chunk([op.ChatChunkChoice(index=i, delta=op.Delta(content=pending_text[i]))])
                    pending_text[i] = ""
            elif ev.kind == "logprobs" and want_logprobs and not called[i]:
                logprobs = oa.chat_logprobs(ev.chunk.token_ids, ev.chunk.logprobs, ev.chunk.top_logprobs, api.texts)
                yield chunk([op.ChatChunkChoice(index=i, delta=op.Delta(content=pending_text[i]), logprobs=logprobs)])
                pending_text[i] = ""
            elif ev.kind == "reasoning":
                yield chunk([op.ChatChunkChoice(index=i, delta=op.Delta(reasoning_content=ev.text))])
            elif ev.kind == "call":
                called[i] = True
                delta = op.Delta(content=None, tool_calls=[op.ToolCallDelta(
                    index=ev.call_index, id=ev.call_id, type="function",
                    function=op.FunctionCallDelta(name=ev.name, arguments=""))])
                yield chunk([op.ChatChunkChoice(index=i, delta=delta)])
            elif ev.kind == "args":
                delta = op.Delta(content=None, tool_calls=[op.ToolCallDelta(
                    index=ev.call_index, function=op.FunctionCallDelta(arguments=ev.text))])
                yield chunk([op.ChatChunkChoice(index=i, delta=delta)])
            elif ev.kind == "done":
                result = ev.result
                results[i] = result
                check_result(result)
                if pending_text[i]:
                    yield chunk([op.ChatChunkChoice(index=i, delta=op.Delta(content=pending_text[i]))])
                yield chunk([op.ChatChunkChoice(index=i, delta=op.Delta(),
                                                finish_reason=oa.finish_reason_of(result, bool(ev.output.calls)))])
        if include_usage:
            yield chunk([], usage=oa.usage_of(results[:1], results))
    except Exception as exc:  # noqa: BLE001 - reported in-stream: the status line is gone
        yield sse(op.ErrorResponse(error=api_error_from(exc, "messages").info))
    yield SSE_DONE
