"""A plain chat session over the WebSocket protocol, with optional client-side tools under a
grammar (the base class and the rules every session shares are in :mod:`sgrt.server.session`).

Chat turns re-submit the whole conversation, as token ids that extend the previous turn's ids
exactly (prompt + generated tokens + the new messages' tokens), so the radix cache matches
everything before the new messages and turn N prefills only its new tokens. Between turns the
conversation is unlocked in the cache: under memory pressure it is evicted (LRU) like any other
entry and recomputed on the next turn, so idle sessions never block new requests.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sgrt.engine import SamplingParams
from sgrt.errors import CapacityError, InvalidRequest
from sgrt.server import protocol as p
from sgrt.server.protocol import LimitExceeded
from sgrt.server.session import Session, SessionContext, ws_sampling_params
from sgrt.server.tools import (
    check_tool_choice,
    check_tools,
    parse_tool_call,
    template_renders_tools,
    template_tools,
    tool_grammar,
    tool_results_as_user,
    tools_system_prompt,
    validate_tool_grammar,
)

logger = logging.getLogger("sgrt.server")


@dataclass
class _Conversation:
    """The token ids and the exact text they stand for, as fed to the engine so far."""

    ids: list[int]
    text: str


class ChatSession(Session):
    """Plain chat: ``user`` -> one assistant turn (streamed), possibly a tool call that the
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
        self._grammars: dict[str, str | None] = {}
        self.tokenizer = self.engine.tokenizer
        self.messages: list[dict[str, Any]] = []
        self._template_tools: list[dict] | None = None
        system = start.system
        if self.tools:
            tmpl = template_tools(self.tools)
            if template_renders_tools(self.tokenizer, tmpl):
                self._template_tools = tmpl
            else:
                desc = tools_system_prompt(self.tools)
                system = f"{system}\n\n{desc}" if system else desc
        if system:
            self.messages.append({"role": "system", "content": system})
        self.conv: _Conversation | None = None
        self.handle: Any = None
        self.open_calls: dict[str, str] = {}
        self.tool_rounds = 0
        self._call_ids = itertools.count(1)
        self._tool_role = "tool"

    # -- prompt ----------------------------------------------------------------------------------
    def _render(self) -> str:
        messages = self.messages
        if self._tool_role != "tool":
            messages = tool_results_as_user(messages)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tools=self._template_tools)
        except InvalidRequest:
            raise
        except Exception:  # noqa: BLE001 - e.g. a template that refuses the "tool" role
            if self._tool_role == "tool" and any(m["role"] == "tool" for m in messages):
                self._tool_role = "user"
                return self._render()
            raise

    def _prompt(self) -> tuple[list[int], str]:
        """Token ids of the conversation with the generation prompt; they extend the previous
        turn's ids exactly when the rendered text extends its text (the usual case)."""
        text = self._render()
        conv = self.conv
        if conv is not None and text.startswith(conv.text):
            return conv.ids + self.tokenizer.encode(text[len(conv.text):]), text
        # NOTE: the template re-rendered earlier text differently (e.g. a stop string cut the
        # reply): tokenize everything; the cache still matches whatever prefix is equal.
        return self.tokenizer.encode(text), text

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
        # NOTE: the first turn of a tool choice builds its grammar (every tool's schema): off the loop.
        params = await asyncio.to_thread(self._params, msg.sampling, choice)
        if self.closed:
            return
        self.messages.append({"role": "user", "content": msg.content})
        self.tool_rounds = 0
        self._cancel_requested = False
        self._spawn(self._generate(params))

    async def on_tool_result(self, msg: p.ToolResult) -> None:
        if msg.call_id not in self.open_calls:
            raise p.ProtocolError("unknown_call", f"no open tool call {msg.call_id!r}", field="call_id",
                                  session=self.id)
        choice = msg.tool_choice or "auto"
        check_tool_choice(choice, self.tools)
        name = self.open_calls.pop(msg.call_id)
        self.messages.append({"role": "tool", "name": name, "content": msg.content})
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
        params = await asyncio.to_thread(self._params, None, choice)
        if self.closed:
            return
        self._spawn(self._generate(params))

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
    def _grammar(self, choice: str) -> str | None:
        if choice not in self._grammars:
            self._grammars[choice] = tool_grammar(self.tools, choice)
        return self._grammars[choice]

    def _params(self, override: p.Sampling | None, choice: str) -> SamplingParams:
        """The turn's params, built once: the session's sampling, the turn's override and the
        tool grammar of ``choice``."""
        grammar = self._grammar(choice)
        extra = {} if grammar is None else {"grammar": grammar}
        return ws_sampling_params(self.sampling_base, override, self.limits, **extra)

    async def _generate(self, params: SamplingParams) -> None:
        self.turn += 1
        turn = self.turn
        # NOTE: rendering + tokenizing a long conversation is CPU work: off the event loop.
        ids, text = await asyncio.to_thread(self._prompt)
        grammar = params.grammar
        try:
            handle = self.engine.submit(ids, params)
        except (InvalidRequest, CapacityError) as exc:
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()  # the turn never ran; the client may retry shorter
            await self.send_error(exc)
            await self.send(p.Done(session=self.id, turn=turn, reason="error"))
            return
        self.handle = handle
        if self._cancel_requested:
            self.engine.abort(handle.request_id)
        result = None
        is_call: bool | None = None if grammar is not None else False
        try:
            async for chunk in handle.astream():
                if chunk.text:
                    if is_call is None:
                        is_call = chunk.text[0] == "{"
                    if not is_call:
                        await self.send(p.Token(session=self.id, turn=turn, text=chunk.text))
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
        await self._finish_turn(turn, ids, text, result, bool(is_call))

    async def _finish_turn(self, turn: int, ids: list[int], text: str, result: Any, is_call: bool) -> None:
        out_ids = list(result.token_ids)
        self.conv = _Conversation(ids + out_ids, text + self.tokenizer.decode(out_ids, skip_special_tokens=False))
        self.messages.append({"role": "assistant", "content": result.text})
        call = None
        if is_call and result.finish_reason == "stop":
            parsed = parse_tool_call(result.text, self.tools)
            if parsed is not None:
                call = p.ToolCallInfo(call_id=f"call-{next(self._call_ids)}", name=parsed[0], arguments=parsed[1])
        await self.send(p.Message(
            session=self.id, turn=turn, content=result.text, finish_reason=result.finish_reason,
            tool_call=call, ttft=result.ttft, prompt_tokens=result.prompt_tokens,
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
        if call is not None and not self._cancel_requested:
            self.open_calls[call.call_id] = call.name
            await self.send(p.ToolCall(session=self.id, turn=turn, call_id=call.call_id, name=call.name,
                                       arguments=call.arguments))
            return
        reason = "cancelled" if self._cancel_requested else "turn"
        await self.send(p.Done(session=self.id, turn=turn, reason=reason))
