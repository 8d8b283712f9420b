"""OpenAI's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``DELETE /v1/responses/{id}``.

Follows https://platform.openai.com/docs/api-reference/responses for what a local text model
can do: ``input`` (a string, or a list of items: messages, ``function_call``,
``function_call_output``; ``reasoning`` items are skipped), ``instructions``, function
``tools`` with ``tool_choice`` and ``parallel_tool_calls``, ``text.format`` (``text``,
``json_object``, ``json_schema``), ``max_output_tokens``, ``temperature`` / ``top_p``,
``reasoning.effort`` (the template's thinking switch), ``stream`` (the documented event
sequence: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.function_call_arguments.delta`` ... ``.done``, ``response.output_item.done``,
``response.completed`` or ``response.incomplete``), usage with cached tokens.

A request is translated into a chat request (:func:`to_chat_request`), so tools, grammars and
limits are the chat API's. Every field is typed (msgspec structs below): a wrong type is a 400
naming it, never a failure further in. ``metadata`` has OpenAI's bounds (16 pairs, keys of 64
characters, string values of 512). ``store`` (default true) keeps the response and its
conversation in a bounded LRU store (:class:`ResponseStore`: :data:`MAX_STORED_RESPONSES`
entries and ``max_store_bytes`` per server, in memory, lost at restart); ``previous_response_id`` continues that conversation: its
messages are rendered again ahead of the new input, so the prompt starts with the previous
turn's tokens and the radix cache serves them (``usage.input_tokens_details.cached_tokens``).
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request

from sgrt.errors import InvalidRequest
from sgrt.server.http.core import EngineCall, HttpApi
from sgrt.server.http.errors import ApiError, api_error_from, check_result, json_response
from sgrt.server.http.streams import EventStream
from sgrt.server.limits import HttpLimits, check_count
from sgrt.server.openai import adapter as oa
from sgrt.server.openai import chat_turns as ct
from sgrt.server.openai import protocol as op

#: Responses kept per server for ``previous_response_id`` / ``GET`` (least recently used
#: dropped first).
MAX_STORED_RESPONSES = 512


# ---- wire types (every shape checked when the body is decoded, or, for an input item, whose
# shape depends on its "type", when it is converted: nothing downstream meets a wrong type) ----


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``text.format``: ``{"type": "text" | "json_object" | "json_schema", ...}``."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``text``: the output's ``format`` (and ``verbosity``, ignored)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of ``tools``; only ``type: "function"`` is supported (others are refused by
    name, so their own fields are not checked)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An object ``tool_choice``: ``{"type": "function", "name"}`` or ``{"type":
    "allowed_tools", "mode", "tools"}``."""

    type: str
    name: str | None = None
    mode: str | None = None
    tools: list[dict[str, Any]] | None = None


class Reasoning(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``reasoning``: ``effort`` maps to the template's thinking switch."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """A part of an input item's content (``input_text``, ``output_text``, ``refusal``...)."""

    type: str
    text: str | None = None
    refusal: str | None = None


Content = str | list[ContentPart] | None


class MessageItem(msgspec.Struct, kw_only=True):
    type: str = "message"
    role: str
    content: Content = None


class FunctionCallItem(msgspec.Struct, kw_only=True):
    type: str
    call_id: str
    name: str
    arguments: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    type: str
    call_id: str
    output: Content = None


ITEM_TYPES: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                               "function_call_output": FunctionCallOutputItem}


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses`` (fields of OpenAI's ``ResponseCreateParams``; those that do not
    apply to a local server are accepted and logged as ignored). ``input`` items are objects
    whose fields are checked per ``type`` (:func:`input_messages`); ``metadata`` follows
    OpenAI's bounds (16 pairs, 64-character keys, 512-character string values)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: Reasoning | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: op.Metadata | None = None
    # Accepted and ignored (logged).
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    moderation: Any = None
    context_management: Any = None


IGNORED_FIELDS = ("user", "include", "truncation", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                  "prompt_cache_options", "safety_identifier", "max_tool_calls", "moderation", "context_management")


# ==== the store ===================================================================================


@dataclass
class StoredResponse:
    """A stored response: its JSON object and the conversation after it (chat messages).
    ``size`` is what it costs the store: its encoded bytes (set by :meth:`ResponseStore.put`
    when left at 0)."""

    body: dict[str, Any]
    messages: list[op.ChatMessage]
    size: int = 0


class ResponseStore:
    """Stored responses by id: at most ``capacity`` of them and ``max_bytes`` (their JSON
    encoding) together, least recently used dropped first; one larger than ``max_bytes`` alone
    is not kept. Thread-safe (responses are stored from worker threads)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = 64 << 20):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, item: StoredResponse) -> bool:
        """Store ``item`` under ``rid``; False when it alone exceeds ``max_bytes`` (not kept)."""
        if not item.size:
            item.size = len(msgspec.json.encode(item.body)) + len(msgspec.json.encode(item.messages))
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self.bytes -= old.size
            if item.size > self.max_bytes:
                return False
            self._items[rid] = item
            self.bytes += item.size
            while len(self._items) > self.capacity or self.bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self.bytes -= dropped.size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            item = self._items.pop(rid, None)
            if item is not None:
                self.bytes -= item.size
            return item is not None

    def __len__(self) -> int:
        return len(self._items)


def store_of(api: HttpApi) -> ResponseStore:
    """The server's response store (made on first use, bounded by ``max_store_bytes``)."""
    store = getattr(api, "response_store", None)
    if store is None:
        store = ResponseStore(max_bytes=api.limits.max_store_bytes)
        api.response_store = store
    return store


# ==== request -> chat =============================================================================


def _text_of(content: Content, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(part.text or "")
        elif part.type == "refusal":
            parts.append(part.refusal or "")
        else:
            raise InvalidRequest(f"only text content parts are supported, got {part.type!r}",
                                 field=f"{field}[{j}].type")
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[op.ChatMessage]:
    """``input`` as chat messages: consecutive ``function_call`` items join the assistant
    message before them; ``function_call_output`` becomes a ``tool`` message. Each item is
    checked against its type's wire struct first (``MessageItem``, ``FunctionCallItem``,
    ``FunctionCallOutputItem``; ``reasoning`` items are skipped unread).

    Raises:
        InvalidRequest: an unknown item type or role, or a field of the wrong type
            (``input[i]...``).
    """
    if isinstance(items, str):
        return [op.ChatMessage(role="user", content=items)]
    out: list[op.ChatMessage] = []
    for i, raw in enumerate(items):
        kind = raw.get("type", "message")
        if kind == "reasoning":
            continue  # the model's own earlier thinking: not rendered again (as templates drop it)
        wire = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if wire is None:
            raise InvalidRequest(f"input item type {kind!r} is not supported (message, function_call, "
                                 "function_call_output, reasoning)", field=f"input[{i}].type")
        item = op.convert(raw, wire, f"input[{i}]")
        if isinstance(item, MessageItem):
            if item.role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"role must be user, system, developer or assistant, got {item.role!r}",
                                     field=f"input[{i}].role")
            out.append(op.ChatMessage(role=item.role, content=_text_of(item.content, f"input[{i}].content")))
        elif isinstance(item, FunctionCallItem):
            call = op.ToolCall(id=item.call_id, function=op.ToolCallFunction(
                name=item.name, arguments=item.arguments or "{}"))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = (out[-1].tool_calls or []) + [call]
            else:
                out.append(op.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(op.ChatMessage(role="tool", tool_call_id=item.call_id,
                                      content=_text_of(item.output, f"input[{i}].output")))
    return out


def _tools(tools: list[Tool] | None) -> list[op.ToolDef] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise InvalidRequest(f"only function tools are supported, got {t.type!r}", field=f"tools[{i}].type")
        if t.name is None:
            raise InvalidRequest("a function tool needs a name", field=f"tools[{i}].name")
        out.append(op.ToolDef(function=op.FunctionDef(
            name=t.name, description=t.description or "",
            parameters=t.parameters if t.parameters is not None else {"type": "object", "properties": {}},
            strict=t.strict)))
    return out


def _tool_choice(choice: str | ToolChoice | None) -> str | op.NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type == "function" and choice.name is not None:
        return op.NamedToolChoice(function=op.ToolChoiceFunction(name=choice.name))
    if choice.type == "allowed_tools":
        return choice.mode or "auto"
    raise InvalidRequest(f"tool_choice of type {choice.type!r} is not supported (auto, none, required, or a "
                         "function with its name)", field="tool_choice")


def _response_format(text: TextConfig | None) -> op.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if fmt.type == "json_schema":
        return op.ResponseFormat(type="json_schema", json_schema=op.JsonSchemaSpec(
            name=fmt.name or "response", schema=fmt.schema, strict=fmt.strict))
    if fmt.type in ("text", "json_object"):
        return op.ResponseFormat(type=fmt.type)
    raise InvalidRequest(f"text.format.type must be text, json_object or json_schema, got {fmt.type!r}",
                         field="text.format.type")


def to_chat_request(req: ResponsesRequest, history: list[op.ChatMessage],
                    limits: Any = None) -> tuple[op.ChatCompletionRequest, list[op.ChatMessage]]:
    """The chat request of a Responses request after ``history`` (a stored conversation), and
    the conversation to store (history + input, without ``instructions``, which do not carry
    over to the next response, as OpenAI documents). ``limits`` (:class:`HttpLimits`): the
    conversation's messages count against ``max_messages``.

    Raises:
        InvalidRequest: a bad item, tool, ``tool_choice`` or ``text.format`` (named), or a
            conversation over ``max_messages``.
    """
    limits = limits or HttpLimits()
    conversation = history + input_messages(req.input)
    if not conversation:
        raise InvalidRequest("input must not be empty", field="input")
    if history:
        check_count(conversation, limits.max_messages, "max_messages", "input")
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, op.ChatMessage(role="system", content=req.instructions))
    effort = req.reasoning.effort if req.reasoning is not None else None
    chat = op.ChatCompletionRequest(
        model=req.model, messages=messages, tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        reasoning_effort=effort, stream=bool(req.stream))
    return chat, conversation


# ==== output ======================================================================================


def _usage(result: Any) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: op.ToolCallOut, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": status}


def reasoning_item(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


@dataclass
class _Ctx:
    api: HttpApi
    req: ResponsesRequest
    rid: str
    created: int
    conversation: list[op.ChatMessage]


def response_body(ctx: _Ctx, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  incomplete: str | None = None) -> dict[str, Any]:
    req = ctx.req
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": ctx.rid, "object": "response", "created_at": ctx.created, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "metadata": req.metadata or {}, "model": ctx.api.model_name,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": tool_choice, "tools": req.tools or [],
        "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": req.store is not False,
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
        "user": req.user, "background": False, "service_tier": "default",
    }


def output_items(out: oa.TurnOutput) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if out.reasoning:
        items.append(reasoning_item(out.reasoning, _item_id("rs")))
    if out.content:
        items.append(message_item(out.content, _item_id("msg")))
    for call in out.calls or []:
        items.append(call_item(call, _item_id("fc")))
    return items


def _finish(ctx: _Ctx, out: oa.TurnOutput, result: Any, output: list[dict[str, Any]]) -> dict[str, Any]:
    incomplete = "max_output_tokens" if result.finish_reason == "length" else None
    body = response_body(ctx, "incomplete" if incomplete else "completed", output, _usage(result), incomplete)
    if ctx.req.store is not False:
        reply = op.ChatMessage(role="assistant", content=out.content, tool_calls=[
            op.ToolCall(id=c.id, function=op.ToolCallFunction(name=c.function.name, arguments=c.function.arguments))
            for c in out.calls] if out.calls else None)
        store_of(ctx.api).put(ctx.rid, StoredResponse(body, ctx.conversation + [reply]))
    return body


# ==== endpoints ===================================================================================


async def create_response(api: HttpApi, request: Request) -> Any:
    """``POST /v1/responses``: one engine request; a Response object, or its event stream."""
    req: ResponsesRequest = await api.decode(request, ResponsesRequest)
    ct.warn_ignored(req, IGNORED_FIELDS, thinking=True)
    limits = api.limits
    if isinstance(req.input, list):
        check_count(req.input, limits.max_messages, "max_messages", "input")
    check_count(req.tools, limits.max_tools, "max_tools", "tools")
    history: list[op.ChatMessage] = []
    if req.previous_response_id:
        prev = store_of(api).get(req.previous_response_id)
        if prev is None:
            raise ApiError(400, f"previous response {req.previous_response_id!r} not found (not stored, or "
                           f"dropped: the store keeps {MAX_STORED_RESPONSES} responses and max_store_bytes "
                           f"({limits.max_store_bytes}))", param="previous_response_id",
                           code="previous_response_not_found")
        history = list(prev.messages)

    def prepare() -> tuple[ct.PreparedTurn, list[op.ChatMessage]]:  # NOTE: off the loop
        chat, conversation = to_chat_request(req, history, limits)
        return ct.prepare_turn(api, chat, {**oa.CHAT_FIELD_NAMES, "max_tokens": "max_output_tokens"}), conversation

    turn, conversation = await api.offload(prepare)
    handles = api.submit([EngineCall(turn.prompt_ids, turn.params[0], 0)])
    ctx = _Ctx(api, req, f"resp_{uuid.uuid4().hex}", int(time.time()), conversation)
    if req.stream:
        primed = await api.prime(request, handles)
        return EventStream(_events(ctx, primed, turn.plan), lambda: api.release(handles))
    result = (await api.results(request, handles))[0]
    check_result(result)

    def finish() -> dict[str, Any]:  # NOTE: off the loop: storing measures the conversation's bytes
        out = oa.read_turn(result.text, turn.plan, result.finish_reason)
        return _finish(ctx, out, result, output_items(out))

    return await api.respond(finish)


def _sse(seq: list[int], event: dict[str, Any]) -> bytes:
    event["sequence_number"] = seq[0]
    seq[0] += 1
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


async def _events(ctx: _Ctx, primed: list, plan: oa.ToolPlan) -> AsyncIterator[bytes]:
    seq = [0]
    yield _sse(seq, {"type": "response.created", "response": response_body(ctx, "in_progress", [], None)})
    yield _sse(seq, {"type": "response.in_progress", "response": response_body(ctx, "in_progress", [], None)})
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None  # the item being streamed
    texts = {"text": "", "reasoning": ""}

    def close_open() -> list[bytes]:
        nonlocal open_item
        if open_item is None:
            return []
        item, index = open_item, len(output)
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            text = texts["text"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": text, "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": part}]
            done = message_item(text, item["id"])
        elif item["type"] == "reasoning":
            text = texts["reasoning"]
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": text})
            done = reasoning_item(text, item["id"])
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
            done = {**item, "status": "completed"}
        events.append({"type": "response.output_item.done", "output_index": index, "item": done})
        output.append(done)
        open_item = None
        return [_sse(seq, e) for e in events]

    def open_new(item: dict[str, Any]) -> list[bytes]:
        nonlocal open_item
        out = close_open()
        open_item = item
        index = len(output)
        added = {**item, "status": "in_progress"} if item["type"] != "reasoning" else item
        out.append(_sse(seq, {"type": "response.output_item.added", "output_index": index, "item": added}))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(_sse(seq, {"type": "response.content_part.added", "item_id": item["id"],
                                  "output_index": index, "content_index": 0, "part": part}))
        return out

    try:
        async for ev in ct.turn_events(primed, plan):
            if ev.kind == "reasoning":
                if open_item is None or open_item["type"] != "reasoning":
                    for b in open_new(reasoning_item("", _item_id("rs"))):
                        yield b
                texts["reasoning"] += ev.text
                yield _sse(seq, {"type": "response.reasoning_text.delta", "item_id": open_item["id"],
                                 "output_index": len(output), "content_index": 0, "delta": ev.text})
            elif ev.kind == "text":
                if open_item is None or open_item["type"] != "message":
                    if not ev.text.strip() and open_item is None and not texts["text"]:
                        continue  # no message item for leading whitespace alone
                    texts["text"] = ""
                    for b in open_new(message_item("", _item_id("msg"), "in_progress")):
                        yield b
                texts["text"] += ev.text
                yield _sse(seq, {"type": "response.output_text.delta", "item_id": open_item["id"],
                                 "output_index": len(output), "content_index": 0, "delta": ev.text,
                                 "logprobs": []})
            elif ev.kind == "call":
                call = op.ToolCallOut(id=ev.call_id, function=op.FunctionCallOut(name=ev.name, arguments=""))
                for b in open_new(call_item(call, _item_id("fc"), "in_progress")):
                    yield b
            elif ev.kind == "args":
                open_item["arguments"] += ev.text
                yield _sse(seq, {"type": "response.function_call_arguments.delta", "item_id": open_item["id"],
                                 "output_index": len(output), "delta": ev.text})
            elif ev.kind == "done":
                check_result(ev.result)
                for b in close_open():
                    yield b
                body = await ctx.api.offload(_finish, ctx, ev.output, ev.result, output)
                kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
                yield _sse(seq, {"type": kind, "response": body})
    except Exception as exc:  # noqa: BLE001 - reported in-stream: the status line is gone
        err = api_error_from(exc, "input").info
        yield _sse(seq, {"type": "error", "code": err.code, "message": err.message, "param": err.param})


async def get_response(api: HttpApi, request: Request) -> Any:
    """``GET /v1/responses/{response_id}``: a stored response (404 when unknown or dropped)."""
    api.check_auth(request)
    rid = request.path_params["response_id"]
    item = store_of(api).get(rid)
    if item is None:
        raise ApiError(404, f"response {rid!r} not found", param="response_id", code="not_found")
    return json_response(item.body)


async def delete_response(api: HttpApi, request: Request) -> Any:
    """``DELETE /v1/responses/{response_id}``."""
    api.check_auth(request)
    rid = request.path_params["response_id"]
    if not store_of(api).delete(rid):
        raise ApiError(404, f"response {rid!r} not found", param="response_id", code="not_found")
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})
