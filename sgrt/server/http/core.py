"""The state behind the HTTP routes: the engine, limits, auth, request bodies, and in-flight
accounting of engine requests (submit all or none, 429 over the queue limit, abort what a
client left behind)."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

import sgrt
from sgrt.engine import EngineClient, RequestHandle, SamplingParams, StreamChunk
from sgrt.errors import ContextLengthExceeded, InvalidRequest
from sgrt.server.http.errors import ApiError, ClientGone, json_response
from sgrt.server.http.streams import until_disconnect
from sgrt.server.limits import HttpLimits, check_json_depth, origin_allowed
from sgrt.server.openai import adapter as oa
from sgrt.server.openai import protocol as op


#: Bodies above this size are "heavy": their CPU work (parsing, rendering, tokenizing) runs on
#: a separate small pool, so a few multi-megabyte requests cannot occupy every worker thread that
#: ordinary requests need.
HEAVY_BODY_BYTES = 256 << 10
#: sgrt's native endpoints (served by :mod:`sgrt.server.sglang.endpoints`; listed in the model card).
NATIVE_ENDPOINTS = ("/generate", "/tokenize", "/detokenize", "/apply_chat_template", "/flush_cache",
                    "/abort_request", "/model_info", "/server_info")
_heavy_request: contextvars.ContextVar[bool] = contextvars.ContextVar("sgrt_heavy_request", default=False)


@dataclass
class EngineCall:
    """One engine request of an HTTP request: choice ``index`` of prompt ``prompt_index``."""

    prompt_ids: list[int]
    params: SamplingParams
    index: int
    prompt_index: int = 0
    prompt_text: str = ""


class HttpApi:
    """The state behind the routes: the engine, limits, auth, in-flight accounting.

    Args:
        engine: the :class:`~sgrt.engine.client.EngineClient` (its owner starts and shuts it
            down); sizes are read from its ``info``.
        model_name: the model id reported by ``/v1/models`` and in responses.
        model_aliases: other names a request's ``model`` may give; any other name is answered
            404 ``model_not_found`` (as OpenAI and vLLM answer), no name at all is accepted;
            SGLang's native ``/generate`` ignores ``model`` (what a router forwards, as SGLang does).
        auth_token: when set, requests need it (``Authorization: Bearer`` or ``x-api-key``).
        limits: :class:`HttpLimits`.
    """

    def __init__(self, engine: EngineClient, model_name: str, auth_token: str | None = None,
                 limits: HttpLimits | None = None, model_aliases: Sequence[str] = ()):
        self.engine = engine
        self.info = engine.info
        self.tokenizer = self.info.tokenizer
        self.model_name = model_name
        self.model_names = list(dict.fromkeys([model_name, *model_aliases]))
        self.auth_token = auth_token or None
        self.limits = limits or HttpLimits()
        self.renderer = oa.ChatRenderer(self.tokenizer)
        self.texts = oa.TokenTexts(self.tokenizer)
        self.bos_id = oa.bos_id(self.tokenizer)
        self.bodies_read = 0  # request bodies read in full (tests use it to order events)
        self.closing = False
        self.created = int(time.time())
        self._live: dict[str, RequestHandle] = {}  # request id -> handle, for in-flight accounting
        self._heavy_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sgrt-http-heavy")

    # ---- request plumbing ---------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        """Raises ``ApiError(401)`` unless the token matches (or none is required).

        The token is read from ``Authorization: Bearer <token>`` (the OpenAI SDKs) or from
        ``x-api-key: <token>`` (the Anthropic SDK, which sends only that header); either one
        matching is enough. Compared in constant time.
        """
        if self.auth_token is None:
            return
        expected = self.auth_token.encode()
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        offered = [bearer.strip()] if scheme.lower() == "bearer" else []
        if "x-api-key" in request.headers:
            offered.append(request.headers["x-api-key"].strip())
        if not any(hmac.compare_digest(token.encode(), expected) for token in offered):
            raise ApiError(401, "missing or invalid API key: send Authorization: Bearer <token> or x-api-key: <token>",
                           param="authorization", code="invalid_api_key")

    def check_model(self, model: Any) -> None:
        """Raises ``ApiError(404, model_not_found)`` when ``model`` names none of
        :attr:`model_names` (a missing or empty ``model`` passes)."""
        if model is None or model == "" or model in self.model_names:
            return
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in self.model_names)}", param="model", code="model_not_found")

    def check_available(self) -> None:
        """Raises ``ApiError(503)`` when the engine is not running or the server is closing."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="closing")
        if not engine_alive(self.engine):
            raise ApiError(503, "the engine is not running", type="service_unavailable", code="engine_unavailable")

    def check_origin(self, request: Request) -> None:
        """Raises ``ApiError(403)`` for a browser request from an Origin that is neither loopback
        nor in ``allowed_origins`` (no Origin header: a non-browser client, allowed)."""
        origin = request.headers.get("origin")
        if origin is not None and not origin_allowed(origin, self.limits.allowed_origins):
            raise ApiError(403, f"Origin {origin!r} is not allowed; start the server with --allowed-origin "
                           f"{origin} to allow it", param="origin", code="origin_not_allowed")

    @staticmethod
    def check_content_type(request: Request, body: bytes) -> None:
        """Raises ``ApiError(415)`` for a POST whose Content-Type is not ``application/json``
        (a browser's CORS-simple ``text/plain`` or form POST). A POST with neither a body nor
        a Content-Type (``curl -X POST``) passes."""
        ctype = request.headers.get("content-type")
        if ctype is None and not body:
            return
        media = (ctype or "").split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise ApiError(415, f"Content-Type must be application/json, got {ctype!r}", param="content-type",
                           code="unsupported_media_type")

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 past ``max_body_bytes`` (declared or actual) and
        with 408 when it takes longer than ``body_timeout_s`` to arrive."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body ({declared} bytes) exceeds max_body_bytes ({limit})",
                           code="request_too_large")
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body exceeds max_body_bytes ({limit})", code="request_too_large")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), timeout=self.limits.body_timeout_s)
        except ClientDisconnect:
            raise ClientGone() from None
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within body_timeout_s "
                           f"({self.limits.body_timeout_s:g} s)", code="request_timeout",
                           headers={"connection": "close"}) from None
        self.bodies_read += 1
        return b"".join(chunks)

    async def request_body(self, request: Request) -> bytes:
        """Origin, auth, Content-Type and the body (see :meth:`read_body`)."""
        self.check_origin(request)
        self.check_auth(request)
        body = await self.read_body(request)
        self.check_content_type(request, body)
        return body

    async def decode(self, request: Request, kind: type, check_model: bool = True) -> Any:
        """Origin, auth, Content-Type, availability, body, nesting depth and strict decoding into
        ``kind``, then (``check_model``) the body's ``model`` against :attr:`model_names`. Depth
        check and decoding run on a worker thread (a 4 MB body must not hold the event loop)."""
        body = await self.request_body(request)
        self.check_available()
        _heavy_request.set(len(body) > HEAVY_BODY_BYTES)
        if not body.strip():
            raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
        depth = self.limits.max_json_depth

        def parse() -> Any:
            check_json_depth(body, depth)
            try:
                return msgspec.json.decode(body, type=kind)
            except RecursionError:  # NOTE: only when max_json_depth is set above msgspec's own bound
                raise InvalidRequest("the request body nests too deeply", field="body") from None

        req = await self.offload(parse)
        if check_model:
            self.check_model(getattr(req, "model", None))
        return req

    async def offload(self, fn: Any, *args: Any) -> Any:
        """Run CPU work (parsing, chat-template rendering, tokenizing a long prompt) on a worker
        thread, so that one large request does not stall every other client on the event loop;
        a request whose body is over :data:`HEAVY_BODY_BYTES` uses a separate 2-thread pool."""
        pool = self._heavy_pool if _heavy_request.get() else None
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    async def respond(self, build: Any) -> Response:
        """A 200 JSON response whose body ``build()`` makes, built and encoded on a worker
        thread: a response can hold hundreds of thousands of entries (token ids, log-probabilities
        of a long prompt for every choice), too much Python work for the event loop."""
        return json_response(await self.offload(lambda: msgspec.json.encode(build())))

    def shutdown_workers(self) -> None:
        """Stop the heavy-request pool (server close); work in progress finishes on its own."""
        self._heavy_pool.shutdown(wait=False, cancel_futures=True)

    # ---- engine requests ----------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Engine requests of this API not finished yet (what ``max_queue`` bounds). A request
        leaves the count when the engine finishes it, not when its response has been sent: a
        client that stops reading its stream does not hold queue places (its socket is cut
        after ``write_timeout_s``)."""
        done = [rid for rid, handle in self._live.items() if handle.done]
        for rid in done:
            del self._live[rid]
        return len(self._live)

    def submit(self, calls: Sequence[EngineCall], rids: Sequence[str | None] | None = None) -> list[RequestHandle]:
        """Submit every call or none: 429 when they would take the in-flight count past
        ``max_queue``; an engine refusal (InvalidRequest, ...) aborts those already submitted."""
        limit = self.limits.max_queue
        in_flight = self.in_flight
        if in_flight + len(calls) > limit:
            raise ApiError(429, f"too many requests in flight ({in_flight} + {len(calls)} > max_queue "
                           f"{limit}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"retry-after": "1"})
        handles: list[RequestHandle] = []
        try:
            for i, call in enumerate(calls):
                rid = rids[i] if rids else None
                if rid is not None and rid in self._live:
                    raise InvalidRequest(f"rid {rid!r} is already in flight", field="rid")
                # NOTE: the engine checks every id of a prompt in Python, here on the event loop:
                # a prompt is cut to the window (or refused) first, so that work stays small.
                call.prompt_ids = self.fit_prompt(call.prompt_ids, call.params)
                handle = self.engine.submit(call.prompt_ids, call.params, request_id=rid)
                self._live[handle.request_id] = handle
                handles.append(handle)
        except BaseException:
            self.release(handles)
            raise
        return handles

    def fit_prompt(self, ids: list[int], params: SamplingParams) -> list[int]:
        """``ids`` when prompt + ``max_tokens`` fit the context window; with ``truncate="left"``
        its last ``context_length - max_tokens`` ids (at least one), as the engine would keep
        them. Constant time unless it cuts (one slice).

        Raises:
            ContextLengthExceeded: (field ``prompt``) it does not fit and may not be cut.
        """
        limit = self.info.context_length
        if len(ids) + params.max_tokens <= limit:
            return ids
        if params.truncate == "left":
            return ids[-max(limit - params.max_tokens, 1):]
        raise ContextLengthExceeded(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
            f"window ({limit} tokens); shorten it or pass truncate='left'", field="prompt")

    def release(self, handles: Sequence[RequestHandle]) -> None:
        """Forget ``handles``; abort those not finished (frees their KV slots). Idempotent."""
        for handle in handles:
            if self._live.pop(handle.request_id, None) is None:
                continue
            if not handle.done:
                self.engine.abort(handle.request_id)

    def abort_all(self) -> None:
        """Abort every engine request in flight (server shutdown): their streams end with
        finish reason ``abort``."""
        for rid, handle in list(self._live.items()):
            if not handle.done:
                self.engine.abort(rid)

    async def results(self, request: Request, handles: list[RequestHandle]) -> list[Any]:
        """Await every handle's Result; a client disconnect aborts them all (ClientGone)."""
        try:
            return await until_disconnect(request, asyncio.gather(*(h.aresult() for h in handles)))
        finally:
            self.release(handles)

    async def prime(self, request: Request, handles: list[RequestHandle]) -> list[tuple[StreamChunk, AsyncIterator]]:
        """Wait for each handle's first chunk (so that an error before the first token, such as
        a grammar that does not compile, is still answered with a status code)."""

        async def first(handle: RequestHandle) -> tuple[StreamChunk, AsyncIterator]:
            it = handle.astream()
            return await it.__anext__(), it

        try:
            return await until_disconnect(request, asyncio.gather(*(first(h) for h in handles)))
        except BaseException:
            self.release(handles)
            raise

    def context_room(self) -> int:
        """Tokens one request may hold: the smaller of the context window and the KV pool."""
        return self.info.context_room

    # ---- models, health -----------------------------------------------------------------------
    def model_card(self, name: str | None = None) -> op.ModelCard:
        """The card of ``name`` (default: the reported model name)."""
        bos = self.bos_id
        return op.ModelCard(
            id=name or self.model_name, created=self.created, max_model_len=self.info.context_length,
            sgrt={"version": sgrt.__version__, "native": list(NATIVE_ENDPOINTS),
                  "context_length": self.info.context_length, "max_total_tokens": self.info.max_total_tokens,
                  "bos_token": None if bos is None else self.tokenizer.decode([bos], skip_special_tokens=False),
                  "limits": self.limits.to_dict()})

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        return json_response(op.ModelList(data=[self.model_card(n) for n in self.model_names]))

    async def model_by_id(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: the model's card when ``model`` is a served name, else 404
        (as OpenAI answers an unknown model)."""
        self.check_auth(request)
        model_id = request.path_params["model_id"]
        self.check_model(model_id)  # (a path segment is never empty)
        return json_response(self.model_card(model_id))

    async def health(self, request: Request) -> Response:
        if self.closing or not engine_alive(self.engine):
            return ApiError(503, "the engine is not running", type="service_unavailable",
                            code="engine_unavailable").response()
        body: dict[str, Any] = {"status": "ok", "model": self.model_name}
        try:
            self.check_auth(request)
        except ApiError:
            return json_response(body)
        body.update(in_flight=self.in_flight, max_queue=self.limits.max_queue, engine=self.engine.stats())
        return json_response(body)


def engine_alive(engine: EngineClient) -> bool:
    """Whether the engine's loop is running."""
    return engine.is_alive()
