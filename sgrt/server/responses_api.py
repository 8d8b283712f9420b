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
limits are the chat API's. ``store`` (default true) keeps the response and its conversation in
a bounded LRU store (:class:`ResponseStore`, :data:`MAX_STORED_RESPONSES` entries per server,
in memory, lost at restart); ``previous_response_id`` continues that conversation: its
messages are rendered again ahead of the new input, so the prompt starts with the previous
turn's tokens and the radix cache serves them (``usage.input_tokens_details.cached_tokens``).
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request

from sgrt.errors import InvalidRequest
from sgrt.server import chat_turns as ct
from sgrt.server import openai_adapter as oa
from sgrt.server import openai_protocol as op
from sgrt.server.http_core import EngineCall, HttpApi
from sgrt.server.http_errors import ApiError, api_error_from, json_response
from sgrt.server.http_openai import check_result
from sgrt.server.http_streams import EventStream

#: Responses kept per server for ``previous_response_id`` / ``GET`` (least recently used
#: dropped first).
MAX_STORED_RESPONSES = 512


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses`` (fields of OpenAI's ``ResponseCreateParams``; those that do not
    apply to a local server are accepted and logged as ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
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
    """A stored response: its JSON object and the conversation after it (chat messages)."""

    body: dict[str, Any]
    messages: list[op.ChatMessage]


class ResponseStore:
    """Stored responses by id, at most ``capacity``, least recently used dropped first."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, item: StoredResponse) -> None:
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def store_of(api: HttpApi) -> ResponseStore:
    """The server's response store (made on first use)."""
    store = getattr(api, "response_store", None)
    if store is None:
        store = ResponseStore()
        api.response_store = store
    return store


# ==== request -> chat =============================================================================


def _text_of(content: Any, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
                parts.append(str(part.get("text", "")))
            elif kind == "refusal":
                parts.append(str(part.get("refusal", "")))
            else:
                raise InvalidRequest(f"only text content parts are supported, got {kind!r}",
                                     field=f"{field}[{j}].type")
        return "".join(parts)
    raise InvalidRequest("content must be a string or a list of parts", field=field)


def input_messages(items: str | list[dict[str, Any]]) -> list[op.ChatMessage]:
    """``input`` as chat messages: consecutive ``function_call`` items join the assistant
    message before them; ``function_call_output`` becomes a ``tool`` message.

    Raises:
        InvalidRequest: an unknown item type or role (``input[i]...``).
    """
    if isinstance(items, str):
        return [op.ChatMessage(role="user", content=items)]
    out: list[op.ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"role must be user, system, developer or assistant, got {role!r}",
                                     field=f"input[{i}].role")
            out.append(op.ChatMessage(role=role, content=_text_of(item.get("content"), f"input[{i}].content")))
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequest(f"a function_call item needs {key}", field=f"input[{i}].{key}")
            call = op.ToolCall(id=item["call_id"], function=op.ToolCallFunction(
                name=item["name"], arguments=item.get("arguments") or "{}"))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = (out[-1].tool_calls or []) + [call]
            else:
                out.append(op.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest("a function_call_output item needs call_id", field=f"input[{i}].call_id")
            out.append(op.ChatMessage(role="tool", tool_call_id=item["call_id"],
                                      content=_text_of(item.get("output"), f"input[{i}].output")))
        elif kind == "reasoning":
            continue  # the model's own earlier thinking: not rendered again (as templates drop it)
        else:
            raise InvalidRequest(f"input item type {kind!r} is not supported (message, function_call, "
                                 "function_call_output, reasoning)", field=f"input[{i}].type")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[op.ToolDef] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise InvalidRequest(f"only function tools are supported, got {t.get('type')!r}", field=f"tools[{i}].type")
        if not isinstance(t.get("name"), str):
            raise InvalidRequest("a function tool needs a name", field=f"tools[{i}].name")
        params = t.get("parameters")
        out.append(op.ToolDef(function=op.FunctionDef(
            name=t["name"], description=t.get("description") or "",
            parameters=params if isinstance(params, dict) else {"type": "object", "properties": {}},
            strict=t.get("strict"))))
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | op.NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return op.NamedToolChoice(function=op.ToolChoiceFunction(name=choice["name"]))
    if choice.get("type") == "allowed_tools":
        return choice.get("mode", "auto")
    raise InvalidRequest(f"tool_choice {choice!r} is not supported (auto, none, required, or a function)",
                         field="tool_choice")


def _response_format(text: dict[str, Any] | None) -> op.ResponseFormat | None:
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        return op.ResponseFormat(type="json_schema", json_schema=op.JsonSchemaSpec(
            name=fmt.get("name", "response"), schema=fmt.get("schema"), strict=fmt.get("strict")))
    if kind in ("text", "json_object"):
        return op.ResponseFormat(type=kind)
    raise InvalidRequest(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                         field="text.format.type")


def to_chat_request(req: ResponsesRequest, history: list[op.ChatMessage]) -> tuple[op.ChatCompletionRequest,
                                                                                     list[op.ChatMessage]]:
    """The chat request of a Responses request after ``history`` (a stored conversation), and
    the conversation to store (history + input, without ``instructions``, which do not carry
    over to the next response, as OpenAI documents)."""
    conversation = history + input_messages(req.input)
    if not conversation:
        raise InvalidRequest("input must not be empty", field="input")
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, op.ChatMessage(role="system", content=req.instructions))
    effort = (req.reasoning or {}).get("effort")
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
    history: list[op.ChatMessage] = []
    if req.previous_response_id:
        prev = store_of(api).get(req.previous_response_id)
        if prev is None:
            raise ApiError(400, f"previous response {req.previous_response_id!r} not found (not stored, or "
                           f"dropped: the store keeps {MAX_STORED_RESPONSES})", param="previous_response_id",
                           code="previous_response_not_found")
        history = list(prev.messages)
    chat, conversation = to_chat_request(req, history)
    turn = await api.offload(ct.prepare_turn, api, chat)  # NOTE: off the loop
    names = {**oa.CHAT_FIELD_NAMES, "max_tokens": "max_output_tokens"}
    handles = api.submit([EngineCall(turn.prompt_ids, oa.build_params(turn.fields, names), 0)])
    ctx = _Ctx(api, req, f"resp_{uuid.uuid4().hex}", int(time.time()), conversation)
    if req.stream:
        primed = await api.prime(request, handles)
        return EventStream(_events(ctx, primed, turn.plan), lambda: api.release(handles))
    result = (await api.results(request, handles))[0]
    check_result(result)
    out = oa.read_turn(result.text, turn.plan, result.finish_reason)
    return json_response(_finish(ctx, out, result, output_items(out)))


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
                body = _finish(ctx, ev.output, ev.result, output)
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
