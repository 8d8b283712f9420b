"""Anthropic's Messages API: ``POST /v1/messages``, so that the ``anthropic`` SDK and tools built
on it work against a local sgrt (as vLLM and llama.cpp allow).

Follows https://docs.anthropic.com/en/api/messages for what a local text model can do:
``system`` (a string or text blocks), ``messages`` with ``text``, ``tool_use`` and
``tool_result`` blocks (``thinking`` blocks are skipped), ``tools`` (``input_schema``) with
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``),
``max_tokens``, ``stop_sequences``, ``temperature`` / ``top_p`` / ``top_k`` (still accepted,
though recent SDKs no longer send them: ``extra_body``), ``thinking``
(the template's thinking switch), and ``stream``: ``message_start``, ``content_block_start``,
``content_block_delta`` (``text_delta``, ``input_json_delta``, ``thinking_delta``),
``content_block_stop``, ``message_delta`` (stop reason, output tokens), ``message_stop``.

The request is translated into a chat request (tools, grammars and limits are the chat
API's). ``usage.input_tokens`` counts the prompt tokens not read from the radix cache and
``cache_read_input_tokens`` those that were, as Anthropic reports prompt caching.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request

from sgrt.errors import InvalidRequest
from sgrt.server.http.core import EngineCall, HttpApi
from sgrt.server.http.errors import ApiError, api_error_from, check_result, json_response
from sgrt.server.http.streams import EventStream
from sgrt.server.limits import check_count, check_stop
from sgrt.server.openai import adapter as oa
from sgrt.server.openai import chat_turns as ct
from sgrt.server.openai import protocol as op


# ---- wire types: every shape is checked when the body is decoded (a content block that is not
# an object, a text that is not a string...: a 400 naming it), so nothing downstream meets a
# wrong type. Blocks keep the fields of every type sgrt reads; which ones a type needs is
# checked where it is read. ----------------------------------------------------------------------


class TextBlock(msgspec.Struct, kw_only=True):
    """A block of ``system`` or of a ``tool_result``'s content: only ``text`` is supported."""

    type: str
    text: str | None = None


class ContentBlock(msgspec.Struct, kw_only=True):
    """A block of a message's content: ``text``, ``tool_use`` (assistant), ``tool_result``
    (user), ``thinking`` / ``redacted_thinking`` (skipped)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class MessageParam(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentBlock]


class ToolParam(msgspec.Struct, kw_only=True):
    """A tool: a custom (client) tool has ``name`` and ``input_schema``."""

    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoiceParam(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/messages`` (fields of Anthropic's ``MessageCreateParams``)."""

    model: str | None = None
    max_tokens: int
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    thinking: ThinkingParam | None = None
    # Accepted and ignored (logged).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    inference_geo: Any = None
    output_config: Any = None
    cache_control: Any = None
    diagnostics: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


IGNORED_FIELDS = ("metadata", "service_tier", "container", "mcp_servers", "context_management", "inference_geo",
                  "output_config", "cache_control", "diagnostics", "speed", "user_profile_id", "workspace_id")


#: HTTP status -> Anthropic's error ``type`` (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error"}


def error_body(err: ApiError) -> dict[str, Any]:
    """``err`` in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}`` (the
    field sgrt names stays as ``param``, with ``code``; the SDK ignores them)."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.info.message, "param": err.info.param,
                                       "code": err.info.code}}


def error_response(err: ApiError) -> Any:
    """The HTTP response of an error on ``/v1/messages`` (same status and headers as the
    OpenAI-shaped one, Anthropic's body)."""
    return json_response(error_body(err), err.status, err.headers)


def _text(content: str | list[TextBlock], field: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if block.type != "text":
            raise InvalidRequest(f"only text blocks are supported here, got {block.type!r}", field=f"{field}[{j}].type")
        parts.append(block.text or "")
    return "".join(parts)


def chat_messages(req: MessagesRequest) -> list[op.ChatMessage]:
    """``system`` + ``messages`` as chat messages: ``tool_use`` blocks become the assistant's
    tool calls, ``tool_result`` blocks ``tool`` messages (ahead of the user's text).

    Raises:
        InvalidRequest: an unknown role or block type, or a ``tool_use`` without its name
            (``messages[i].content[j]...``).
    """
    out: list[op.ChatMessage] = []
    if req.system:
        out.append(op.ChatMessage(role="system", content=_text(req.system, "system")))
    for i, m in enumerate(req.messages):
        role = m.role
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"role must be user or assistant, got {role!r}", field=f"messages[{i}].role")
        texts: list[str] = []
        calls: list[op.ToolCall] = []
        blocks = [ContentBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        for j, block in enumerate(blocks):
            kind = block.type
            field = f"messages[{i}].content[{j}]"
            if kind == "text":
                texts.append(block.text or "")
            elif kind == "tool_use" and role == "assistant":
                if block.name is None:
                    raise InvalidRequest("a tool_use block needs the tool's name", field=f"{field}.name")
                calls.append(op.ToolCall(id=block.id, function=op.ToolCallFunction(
                    name=block.name, arguments=msgspec.json.encode(block.input or {}).decode())))
            elif kind == "tool_result" and role == "user":
                result = "" if block.content is None else _text(block.content, f"{field}.content")
                if block.is_error:
                    result = f"Error: {result}"
                out.append(op.ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=result))
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise InvalidRequest(f"content block type {kind!r} is not supported in a {role} message",
                                     field=f"{field}.type")
        if role == "assistant":
            out.append(op.ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None))
        elif texts or not any(o.role == "tool" for o in out[-1:]):
            out.append(op.ChatMessage(role="user", content="".join(texts)))
    return out


def to_chat_request(req: MessagesRequest) -> op.ChatCompletionRequest:
    """The chat request of a Messages request.

    Raises:
        InvalidRequest: a server tool, an unknown ``tool_choice`` type, a bad message (named).
    """
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise InvalidRequest(f"only custom (client) tools are supported, got {t.type!r}",
                                     field=f"tools[{i}].type")
            tools.append(op.ToolDef(function=op.FunctionDef(
                name=t.name, description=t.description or "",
                parameters=t.input_schema or {"type": "object", "properties": {}})))
    choice: Any = None
    parallel = None
    if req.tool_choice:
        kind = req.tool_choice.type
        parallel = False if req.tool_choice.disable_parallel_tool_use else None
        if kind == "tool":
            if req.tool_choice.name is None:
                raise InvalidRequest("tool_choice of type tool needs the tool's name", field="tool_choice.name")
            choice = op.NamedToolChoice(function=op.ToolChoiceFunction(name=req.tool_choice.name))
        elif kind in ("auto", "none"):
            choice = kind
        elif kind == "any":
            choice = "required"
        else:
            raise InvalidRequest(f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                                 field="tool_choice.type")
    effort = None
    if req.thinking:
        effort = "none" if req.thinking.type == "disabled" else "medium"
    return op.ChatCompletionRequest(
        model=req.model, messages=chat_messages(req), tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
        max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, reasoning_effort=effort, stream=bool(req.stream))


def _usage(result: Any) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
            "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0}


def _stop(result: Any, called: bool, stops: list[str] | None) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    if isinstance(result.matched, str) and stops and result.matched in stops:
        return "stop_sequence", result.matched
    return "end_turn", None


def _content(out: oa.TurnOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for call in out.calls or []:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                       "input": msgspec.json.decode(call.function.arguments)})
    return blocks


async def create_message(api: HttpApi, request: Request) -> Any:
    """``POST /v1/messages``: one engine request; a Message, or its event stream."""
    req: MessagesRequest = await api.decode(request, MessagesRequest)
    ct.warn_ignored(req, IGNORED_FIELDS)
    limits = api.limits
    check_stop(req.stop_sequences, limits.max_stop, limits.max_stop_chars, field="stop_sequences")
    check_count(req.messages, limits.max_messages, "max_messages", "messages")
    check_count(req.tools, limits.max_tools, "max_tools", "tools")
    turn = await api.offload(lambda: ct.prepare_turn(api, to_chat_request(req)))  # NOTE: off the loop
    handles = api.submit([EngineCall(turn.prompt_ids, turn.params[0], 0)])
    mid = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        primed = await api.prime(request, handles)
        return EventStream(_events(api, mid, primed, turn.plan, req), lambda: api.release(handles))
    result = (await api.results(request, handles))[0]
    check_result(result)
    out = oa.read_turn(result.text, turn.plan, result.finish_reason)
    reason, seq = _stop(result, bool(out.calls), req.stop_sequences)
    return json_response({"id": mid, "type": "message", "role": "assistant", "model": api.model_name,
                          "content": _content(out), "stop_reason": reason, "stop_sequence": seq,
                          "usage": _usage(result)})


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


async def _events(api: HttpApi, mid: str, primed: list, plan: oa.ToolPlan, req: MessagesRequest) -> AsyncIterator[bytes]:
    first = primed[0][0]
    usage0 = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    yield _sse({"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": api.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage0}})
    del first
    index = -1
    open_kind: str | None = None

    def start(block: dict[str, Any]) -> list[bytes]:
        nonlocal index, open_kind
        out = [_sse({"type": "content_block_stop", "index": index})] if open_kind else []
        index += 1
        open_kind = block["type"]
        out.append(_sse({"type": "content_block_start", "index": index, "content_block": block}))
        return out

    try:
        async for ev in ct.turn_events(primed, plan):
            if ev.kind == "reasoning":
                if open_kind != "thinking":
                    for b in start({"type": "thinking", "thinking": "", "signature": ""}):
                        yield b
                yield _sse({"type": "content_block_delta", "index": index,
                            "delta": {"type": "thinking_delta", "thinking": ev.text}})
            elif ev.kind == "text":
                if open_kind != "text":
                    if not ev.text.strip() and open_kind is None:
                        continue
                    for b in start({"type": "text", "text": ""}):
                        yield b
                yield _sse({"type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": ev.text}})
            elif ev.kind == "call":
                for b in start({"type": "tool_use", "id": ev.call_id, "name": ev.name, "input": {}}):
                    yield b
            elif ev.kind == "args":
                yield _sse({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": ev.text}})
            elif ev.kind == "done":
                check_result(ev.result)
                if open_kind:
                    yield _sse({"type": "content_block_stop", "index": index})
                reason, seq = _stop(ev.result, bool(ev.output.calls), req.stop_sequences)
                yield _sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                            "usage": _usage(ev.result)})
                yield _sse({"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - reported in-stream: the status line is gone
        yield _sse(error_body(api_error_from(exc, "messages")))
