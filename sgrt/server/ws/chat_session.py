"""A plain chat session over the WebSocket protocol, with optional client-side tools under a
grammar (the base class and the rules every session shares are in :mod:`sgrt.server.ws.session`).

A turn is planned, rendered, constrained and read back by the same code as the HTTP chat APIs
(:class:`~sgrt.server.turns.plan.ChatRenderer`, :class:`~sgrt.server.turns.plan.ToolPlan`,
:class:`~sgrt.server.turns.formats.TurnStreamer`): tool calls in the model family's own format
(Hermes / Qwen, Llama 3, Mistral, generic), several per generation with
``parallel_tool_calls``, their arguments streamed as ``tool_call.delta``, and a thinking
model's ``<think>`` block streamed apart as ``reasoning``.

Chat turns re-submit the whole conversation, as token ids that extend the previous turn's ids
exactly (prompt + generated tokens + the new messages' tokens) when the rendered text extends
it, so the radix cache matches everything before the new messages and turn N prefills only its
new tokens. Between turns the conversation is unlocked in the cache: under memory pressure it is
evicted (LRU) like any other entry and recomputed on the next turn, so idle sessions never block
new requests.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sgrt.engine import Result, SamplingParams
from sgrt.errors import CapacityError, InvalidRequest, SgrtError
from sgrt.server.openai import protocol as op
from sgrt.server.turns import formats as tf
from sgrt.server.turns.plan import ChatRenderer, ToolPlan, plan_choice
from sgrt.server.turns.tools import check_tool_choice, check_tools, validate_tool_grammar
from sgrt.server.ws import protocol as p
from sgrt.server.ws.protocol import LimitExceeded
from sgrt.server.ws.session import Session, SessionContext, ws_sampling_params

logger = logging.getLogger("sgrt.server")


@dataclass
class _Conversation:
    """The token ids and the exact text they stand for, as fed to the engine so far."""

    ids: list[int]
    text: str


@dataclass
class _Turn:
    """A generation ready to submit: the prompt (ids and text), its params and its plan."""

    ids: list[int]
    text: str
    params: SamplingParams
    plan: ToolPlan


class ChatSession(Session):
    """Plain chat: ``user`` -> one assistant turn (streamed), possibly tool calls that the
    client answers with ``tool_result``, after which the turn continues."""

    kind = "chat"

    def __init__(self, sid: str, ctx: SessionContext, start: p.SessionStart):
        super().__init__(sid, ctx, start)
        limits = self.limits
        self.tools = list(start.tools)
        check_tools(self.tools, limits.max_tools)
        if self.tools:
            validate_tool_grammar(self.tools)
        ws_sampling_params({}, start.sampling, limits)  # refuse bad sampling at session.start
        self.sampling_base = start.sampling.fields_set() if start.sampling else {}
        check_tool_choice(start.tool_choice, self.tools)
        self.tool_choice = start.tool_choice
        self.parallel = start.parallel_tool_calls
        self.tokenizer = self.engine.tokenizer
        self.renderer = ChatRenderer(self.tokenizer)
        self.messages: list[op.ChatMessage] = []
        if start.system:
            self.messages.append(op.ChatMessage(role="system", content=start.system))
        self.conv: _Conversation | None = None
        self.handle: Any = None
        self.open_calls: dict[str, str] = {}
        self.tool_rounds = 0
        self._call_ids = itertools.count(1)

    # -- prompt ----------------------------------------------------------------------------------
    def _prepare(self, messages: list[op.ChatMessage], override: p.Sampling | None, choice: str) -> _Turn:
        """Plan, render and tokenize a generation over ``messages`` and build its params (CPU
        work: callers run it off the event loop). The ids extend the previous generation's ids
        exactly when the rendered text extends its text (the usual case).

        Raises:
            InvalidRequest / LimitExceeded / GrammarError: a bad sampling override (field
                ``sampling.<name>``), a tool schema that does not compile, a template failure.
        """
        plan = plan_choice(self.tools, choice, self.parallel, self.renderer.traits.tool_format)
        plan.guard_none = True
        text = self.renderer.render(messages, plan)
        extra: dict[str, Any] = {}
        plan.finish(extra)
        params = ws_sampling_params(self.sampling_base, override, self.limits, **extra)
        conv = self.conv
        if conv is not None and text.startswith(conv.text):
            ids = conv.ids + self.tokenizer.encode(text[len(conv.text):])
        else:
            # NOTE: the template re-rendered earlier text differently (e.g. a stop string cut the
            # reply): tokenize everything; the cache still matches whatever prefix is equal.
            ids = self.tokenizer.encode(text)
        return _Turn(ids, text, params, plan)

    async def _prepared(self, messages: list[op.ChatMessage], override: p.Sampling | None,
                        choice: str) -> _Turn | None:
        """:meth:`_prepare` off the event loop. A client error (a bad field, a schema that does
        not compile) is raised to the caller, which answers it with ``error``; anything else
        fails the turn as a running one does: an ``internal`` error, then ``done`` ("error"),
        and None."""
        try:
            return await asyncio.to_thread(self._prepare, messages, override, choice)
        except (SgrtError, p.ProtocolError):
            raise
        except Exception as exc:  # noqa: BLE001 - reported (error_for logs it, with an incident id)
            await self.send_error(exc)
            await self.send(p.Done(session=self.id, turn=self.turn, reason="error"))
            return None

    # -- messages --------------------------------------------------------------------------------
    async def on_user(self, msg: p.User) -> None:
        if self.busy:
            raise LimitExceeded("limit.generations", "a chat session runs one generation at a time and one is "
                                "running; wait for done or send cancel", field="type")
        if self.open_calls:
            raise p.ProtocolError(
                "bad_state", f"tool call {next(iter(self.open_calls))!r} is open; send its tool_result first",
                field="type", session=self.id)
        choice = msg.tool_choice or self.tool_choice
        check_tool_choice(choice, self.tools)
        user = op.ChatMessage(role="user", content=msg.content)
        # NOTE: rendering, tokenizing and the first turn of a tool choice (every tool's schema): off the loop.
        turn = await self._prepared([*self.messages, user], msg.sampling, choice)
        if turn is None or self.closed:
            return
        self.messages.append(user)
        self.tool_rounds = 0
        self._cancel_requested = False
        self._spawn(self._generate(turn))

    async def on_tool_result(self, msg: p.ToolResult) -> None:
        if msg.call_id not in self.open_calls:
            raise p.ProtocolError("unknown_call", f"no open tool call {msg.call_id!r}", field="call_id",
                                  session=self.id)
        choice = msg.tool_choice or "auto"
        check_tool_choice(choice, self.tools)
        name = self.open_calls.pop(msg.call_id)
        self.messages.append(op.ChatMessage(role="tool", name=name, tool_call_id=msg.call_id, content=msg.content))
        if self.open_calls:
            return
        self.tool_rounds += 1
        if self.tool_rounds > self.limits.max_tool_rounds:
            await self.send_error(LimitExceeded(
                "limit.tools", f"more than max_tool_rounds ({self.limits.max_tool_rounds}) tool calls in one user turn",
                field="tool_result"))
            await self.send(p.Done(session=self.id, turn=self.turn, reason="error"))
            return
        self._cancel_requested = False
        turn = await self._prepared(list(self.messages), None, choice)
        if turn is None or self.closed:
            return
        self._spawn(self._generate(turn))

    async def on_cancel(self) -> None:
        if self.busy:
            self._cancel_requested = True
            self._abort_running()  # the turn then sends message + done("cancelled")
            return
        self.open_calls.clear()
        await self.send(p.Done(session=self.id, turn=self.turn, reason="cancelled"))

    def _abort_running(self) -> None:
        handle = self.handle
        if handle is not None:
            self.engine.abort(handle.request_id)

    # -- one generation --------------------------------------------------------------------------
    async def _generate(self, prepared: _Turn) -> None:
        self.turn += 1
        turn = self.turn
        plan = prepared.plan
        try:
            handle = self.engine.submit(prepared.ids, prepared.params)
        except (InvalidRequest, CapacityError) as exc:
            if self.messages and self.messages[-1].role == "user":
                self.messages.pop()  # the turn never ran; the client may retry shorter
            await self.send_error(exc)
            await self.send(p.Done(session=self.id, turn=turn, reason="error"))
            return
        self.handle = handle
        if self._cancel_requested:
            self.engine.abort(handle.request_id)
        result = None
        streamer = tf.TurnStreamer(plan.fmt, may_call=plan.may_call, think=plan.think)
        call_ids: list[str] = []
        try:
            async for chunk in handle.astream():
                for ev in streamer.feed(chunk.text, final=chunk.finished):
                    await self._send_event(turn, ev, call_ids)
                if chunk.finished:
                    result = chunk.result
        except InvalidRequest as exc:  # refused before it ran, e.g. a grammar that fails to compile
            await self.send_error(exc)
            await self.send(p.Done(session=self.id, turn=turn, reason="error"))
            return
        finally:
            self.handle = None
            if result is None:  # cancelled task (disconnect, close) or a send that failed
                self.engine.abort(handle.request_id)
        await self._finish_turn(turn, prepared, result, streamer, call_ids)

    async def _send_event(self, turn: int, ev: tf.StreamEvent, call_ids: list[str]) -> None:
        """One streamed increment as its protocol message."""
        if ev.kind == "text":
            await self.send(p.Token(session=self.id, turn=turn, text=ev.text))
        elif ev.kind == "reasoning":
            await self.send(p.Reasoning(session=self.id, turn=turn, text=ev.text))
        elif ev.kind == "call":
            call_ids.append(f"call-{next(self._call_ids)}")
            await self.send(p.ToolCallDelta(session=self.id, turn=turn, index=ev.index, call_id=call_ids[ev.index],
                                            name=ev.name))
        elif ev.kind == "args":
            await self.send(p.ToolCallDelta(session=self.id, turn=turn, index=ev.index, call_id=call_ids[ev.index],
                                            arguments=ev.text))

    async def _finish_turn(self, turn: int, prepared: _Turn, result: Result, streamer: tf.TurnStreamer,
                           call_ids: list[str]) -> None:
        out_ids = list(result.token_ids)
        self.conv = _Conversation(prepared.ids + out_ids,
                                  prepared.text + self.tokenizer.decode(out_ids, skip_special_tokens=False))
        parsed = streamer.parsed
        finished = tf.finished_calls(parsed, prepared.plan.specs) if result.finish_reason == "stop" else None
        calls: list[p.ToolCallInfo] = []
        for k, c in enumerate(finished or []):
            cid = call_ids[k] if k < len(call_ids) else f"call-{next(self._call_ids)}"
            calls.append(p.ToolCallInfo(call_id=cid, name=c.name, arguments=json.loads(c.arguments)))
        if calls:
            self.messages.append(op.ChatMessage(
                role="assistant", content=parsed.content.strip() or None,
                tool_calls=[op.ToolCall(id=c.call_id, function=op.ToolCallFunction(
                    name=c.name, arguments=json.dumps(c.arguments))) for c in calls]))
        else:
            content = parsed.content if prepared.plan.think is not None else result.text
            self.messages.append(op.ChatMessage(role="assistant", content=content))
        await self.send(p.Message(
            session=self.id, turn=turn, content=result.text, finish_reason=result.finish_reason,
            tool_call=calls[0] if calls else None, ttft=result.ttft, prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens, cached_tokens=result.cached_tokens))
        if result.finish_reason == "abort" and result.error and not self._cancel_requested:
            if result.request_error is not None:  # the request's own fault (its grammar hit a limit)
                await self.send_error(result.request_error)
            else:
                incident = uuid.uuid4().hex[:12]
                logger.error("session %s: generation failed (incident %s): %s", self.id, incident, result.error)
                await self.send(p.Error(code="generation_failed", session=self.id,
                                        message=f"the engine failed the generation (incident {incident}; details "
                                                "in the server log)"))
            await self.send(p.Done(session=self.id, turn=turn, reason="error"))
            return
        if calls and not self._cancel_requested:
            for call in calls:
                self.open_calls[call.call_id] = call.name
            for call in calls:
                await self.send(p.ToolCall(session=self.id, turn=turn, call_id=call.call_id, name=call.name,
                                           arguments=call.arguments))
            return
        reason = "cancelled" if self._cancel_requested else "turn"
        await self.send(p.Done(session=self.id, turn=turn, reason=reason))
