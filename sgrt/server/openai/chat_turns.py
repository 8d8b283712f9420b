"""One assistant turn over the engine, shared by the chat completions, Responses and Messages
APIs: plan the tools and reasoning, render the prompt, build the engine requests, and read the
generated text back, at the end or as a stream of increments (text, reasoning, a call's name,
fragments of its arguments). Each API maps these to its own wire format.

The Responses and Messages APIs translate their requests into an
:class:`~sgrt.server.openai.protocol.ChatCompletionRequest` first, so every field check,
constraint and tool grammar is the chat API's.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sgrt.engine import Result, SamplingParams, StreamChunk
from sgrt.server.http.streams import merge_streams
from sgrt.server.openai import adapter as oa
from sgrt.server.openai import protocol as op
from sgrt.server.sglang import fields as sglang_fields
from sgrt.server.turns import formats as tf

logger = logging.getLogger("sgrt.server.http")

#: Chat request fields that are accepted and mean nothing here (logged once per request).
IGNORED_CHAT_FIELDS = ("verbosity", "modalities", "prediction", "prompt_cache_retention", "audio",
                       "web_search_options", "moderation", "prompt_cache_options", "user", "store", "metadata", "service_tier",
                       "prompt_cache_key", "safety_identifier")


def warn_ignored(req: Any, names: tuple[str, ...] = IGNORED_CHAT_FIELDS, *, thinking: bool = True) -> None:
    """Log the fields of ``req`` that were set but do not apply to a local server (and
    ``reasoning_effort`` when the model has no thinking switch)."""
    ignored = [n for n in names if getattr(req, n, None) not in (None, False)]
    opts = getattr(req, "stream_options", None)
    if opts is not None and getattr(opts, "include_obfuscation", None):
        ignored.append("stream_options.include_obfuscation")
    if getattr(req, "reasoning_effort", None) is not None and not thinking:
        ignored.append("reasoning_effort")
    if ignored:
        logger.warning("ignored request fields (no effect on this server): %s", ", ".join(ignored))


@dataclass
class PreparedTurn:
    """A turn ready for the engine: the plan, the prompt's ids and one
    :class:`SamplingParams` per choice."""

    plan: oa.ToolPlan
    prompt_ids: list[int]
    params: list[SamplingParams]


def prepare_turn(api: Any, req: op.ChatCompletionRequest,
                 field_names: dict[str, str] = oa.CHAT_FIELD_NAMES) -> PreparedTurn:
    """Plan, render and build the params of a chat request (:func:`~sgrt.server.openai.
    sampling.chat_params`; errors name fields as ``field_names`` says). CPU work
    (rendering, tokenizing): callers run it off the event loop (``api.offload``).

    Raises:
        InvalidRequest: a bad field (named), one over the server's limits
            (:func:`~sgrt.server.openai.sampling.check_request_limits`), a prompt over the
            context window, ...
    """
    renderer = api.renderer
    oa.check_request_limits(req, api.limits)
    sglang_fields.check_chat_fields({name: getattr(req, name) for name in (
        "continue_final_message", *sglang_fields.IGNORED_CHAT_FIELDS)})
    warn_ignored(req, thinking=renderer.traits.thinking_switch is not None)
    plan = oa.plan_tools(req, api.limits.max_tools, renderer.traits.tool_format)
    text = renderer.render(req.messages, plan, req.reasoning_effort)
    ids = api.tokenizer.encode(text)
    params = oa.chat_params(req, plan, len(ids), api.context_room(), api.limits, field_names)
    return PreparedTurn(plan, ids, params)


@dataclass
class TurnEvent:
    """An increment of choice ``choice``'s turn: ``kind`` is ``text``, ``reasoning``, ``call``
    (a new call: ``call_index``, ``call_id``, ``name``), ``args`` (a fragment ``text`` of call
    ``call_index``'s arguments), ``logprobs`` (the ``chunk``'s tokens, for text) or ``done``
    (``result`` and the turn read back in ``output``)."""

    choice: int
    kind: str
    text: str = ""
    call_index: int = 0
    call_id: str = ""
    name: str = ""
    chunk: StreamChunk | None = None
    result: Result | None = None
    output: oa.TurnOutput | None = None


@dataclass
class _ChoiceState:
    streamer: tf.TurnStreamer
    call_ids: list[str] = field(default_factory=list)


async def turn_events(primed: list[tuple[StreamChunk, AsyncIterator]], plan: oa.ToolPlan) -> AsyncIterator[TurnEvent]:
    """The increments of every choice's turn, in arrival order, each ending with ``done``."""
    states = [_ChoiceState(tf.TurnStreamer(plan.fmt, may_call=plan.may_call, think=plan.think))
              for _ in primed]
    async for i, c in merge_streams(primed):
        st = states[i]
        for ev in st.streamer.feed(c.text, final=c.finished):
            if ev.kind == "call":
                st.call_ids.append(oa.new_call_id())
                yield TurnEvent(i, "call", call_index=ev.index, call_id=st.call_ids[-1], name=ev.name)
            elif ev.kind == "args":
                yield TurnEvent(i, "args", ev.text, call_index=ev.index)
            else:
                yield TurnEvent(i, ev.kind, ev.text)
        if c.token_ids:
            yield TurnEvent(i, "logprobs", chunk=c)
        if c.finished:
            yield TurnEvent(i, "done", result=c.result, output=streamed_output(st, plan, c.result))


def streamed_output(st: _ChoiceState, plan: oa.ToolPlan, result: Result) -> oa.TurnOutput:
    """The turn of a finished stream read back, reusing the call ids already sent."""
    parsed = st.streamer.parsed
    calls = tf.finished_calls(parsed, plan.specs) if result.finish_reason == "stop" else None
    reasoning = parsed.reasoning if plan.think is not None and (parsed.reasoning or parsed.content
                                                                or parsed.calls) else None
    if calls:
        ids = st.call_ids + [oa.new_call_id() for _ in range(len(calls) - len(st.call_ids))]
        return oa.TurnOutput(parsed.content.strip() or None, reasoning, [
            op.ToolCallOut(id=ids[k], function=op.FunctionCallOut(name=c.name, arguments=c.arguments))
            for k, c in enumerate(calls)])
    return oa.TurnOutput(parsed.content, reasoning, None)
