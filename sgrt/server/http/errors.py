"""Errors of the HTTP API as OpenAI-shaped bodies: ``{"error": {"message", "type", "param",
"code"}}``, and the mapping from sgrt's exception types to HTTP statuses."""
from __future__ import annotations

import logging
import uuid
from typing import Any

import msgspec
from starlette.responses import Response

import sgrt
from sgrt.errors import CapacityError, ContextLengthExceeded, GrammarError, InvalidRequest
from sgrt.server.openai import protocol as op

logger = logging.getLogger("sgrt.server.http")

JSON_ENCODER = msgspec.json.Encoder()
#: Headers of every response; ``x-sgrt-version`` tells clients this is an sgrt server.
BASE_HEADERS = {"x-sgrt-version": sgrt.__version__}


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = op.ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def response(self) -> Response:
        return json_response(op.ErrorResponse(error=self.info), self.status, self.headers)


class ClientGone(Exception):
    """The client disconnected while we waited; its requests were aborted."""


def api_error_from(exc: BaseException, prompt_field: str = "prompt") -> ApiError:
    """The HTTP error for an exception from request handling (``prompt_field`` is what the
    context-length error names: ``messages`` for chat)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, GrammarError):
        return ApiError(400, str(exc), param=exc.field, code="grammar_error")
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, str(exc), param=prompt_field if exc.field == "prompt" else exc.field,
                        code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), param=exc.field, code="invalid_value")
    if isinstance(exc, CapacityError):
        return ApiError(400, str(exc), param="max_tokens", code="capacity_exceeded")
    if isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"invalid request: {exc}", param=_param_of(str(exc)), code="invalid_type")
    if isinstance(exc, msgspec.DecodeError):
        return ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json")
    if isinstance(exc, RecursionError):
        return ApiError(400, "the request nests too deeply", code="too_deep")
    # NOTE: no exception text or traceback goes to the client (it can hold paths, prompts of
    # other requests, library internals); the log has it, under an id the client can quote.
    incident = uuid.uuid4().hex[:12]
    logger.error("request failed (incident %s)", incident, exc_info=exc)
    return ApiError(500, f"internal error (incident {incident}; details in the server log)",
                    type="server_error", code="internal_error")


def generation_error(result: Any) -> ApiError:
    """The error for a request the engine aborted with ``result.error``: the request's own
    fault (``result.request_error``, a typed error naming the field and the limit) maps as any
    request error does (:func:`api_error_from`); anything else is a 500 whose text stays in the
    log under an incident id."""
    if result.request_error is not None:
        return api_error_from(result.request_error)
    incident = uuid.uuid4().hex[:12]
    logger.error("generation failed (incident %s): %s", incident, result.error)
    return ApiError(500, f"generation failed in the engine (incident {incident}; details in the server log)",
                    type="server_error", code="generation_failed")


def _param_of(message: str) -> str | None:
    """The field a msgspec validation message points at: ``Expected `int`, got `str` - at
    `$.n``` -> ``n``; ``Object contains unknown field `foo``` -> ``foo``."""
    path = None
    if " - at `$" in message:
        path = message.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".")
    elif " in `$" in message:  # a dict's key: "... - at `key` in `$.metadata`"
        path = message.rsplit(" in `$", 1)[1].rstrip("`").lstrip(".")
    unknown = None
    if "unknown field `" in message:
        unknown = message.split("unknown field `", 1)[1].split("`", 1)[0]
    if unknown:
        return f"{path}.{unknown}" if path else unknown
    if path:
        return path
    if "missing required field `" in message:
        return message.split("missing required field `", 1)[1].split("`", 1)[0]
    return None


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``obj`` (msgspec-encodable) as a JSON response; ``obj`` may also be JSON already
    encoded (``bytes``, e.g. by :meth:`sgrt.server.http.core.HttpApi.respond` off the loop)."""
    data = obj if isinstance(obj, bytes) else JSON_ENCODER.encode(obj)
    return Response(data, status_code=status, media_type="application/json",
                    headers={**BASE_HEADERS, **(headers or {})})


def check_result(result: Any) -> None:
    """Raise for a request that failed inside the engine (an abort with an error)."""
    if result is not None and result.finish_reason == "abort" and result.error:
        if "engine shut down" in result.error:
            raise ApiError(503, f"the engine stopped: {result.error}", type="service_unavailable",
                           code="engine_unavailable")
        raise generation_error(result)
