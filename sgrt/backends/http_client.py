"""A small thread-safe JSON-over-HTTP client with server-sent events, for :mod:`sgrt.backends.http`.

Standard library only (``http.client``): one keep-alive connection per thread for plain
requests, a fresh connection per stream (closing the stream closes it, which makes an sgrt
server abort the request). OpenAI-style error bodies become sgrt's exception types; 429 and 503
are retried with backoff (``Retry-After`` is honoured) before giving up.

For tests and benchmarks the wire can be swapped: ``transport=`` takes any object with
``send(method, path, payload, stream) -> (status, headers, body bytes)`` (a replay of recorded
exchanges), and ``recorder`` (a list) collects every exchange as a JSON-ready dict
(:func:`exchange_record`), streams included, so real runs can be saved and replayed.
"""
from __future__ import annotations

import http.client
import json
import random
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any, Protocol

from sgrt.errors import CapacityError, ContextLengthExceeded, GrammarError, InvalidRequest, RequestAborted

_RETRY_STATUSES = (429, 503)
#: Response headers worth keeping in a recorded exchange (they identify the server).
RECORDED_HEADERS = ("content-type", "server", "x-sgrt-version", "retry-after")


class Transport(Protocol):
    """A stand-in for the network: answers one request with ``(status, headers, body)``;
    ``headers`` has lower-cased names, and a stream's body is its whole server-sent-event text."""

    def send(self, method: str, path: str, payload: bytes | None, stream: bool) -> tuple[int, dict[str, str], bytes]:
        ...


def exchange_record(method: str, path: str, payload: bytes | None, status: int, headers: dict[str, str],
                    body: bytes, stream: bool) -> dict[str, Any]:
    """One exchange as a JSON-ready dict: ``method``, ``path``, ``request`` (the decoded JSON
    body or None), ``stream``, ``status``, ``headers`` (only :data:`RECORDED_HEADERS`),
    ``response`` (the body as text)."""
    return {"method": method, "path": path, "request": None if payload is None else json.loads(payload),
            "stream": stream, "status": status,
            "headers": {k: v for k, v in headers.items() if k in RECORDED_HEADERS},
            "response": body.decode("utf-8", "replace")}


class HttpStatusError(Exception):
    """A status the caller may want to handle itself (``status``, ``code``, ``param``)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


def error_for(status: int, body: bytes, url: str) -> Exception:
    """The sgrt exception for an error answer (OpenAI-style body or not).

    400 -> :class:`InvalidRequest` (``GrammarError`` for code ``grammar_error``,
    ``ContextLengthExceeded`` for ``context_length_exceeded``) with ``field`` = the ``param``;
    401/403 -> ``InvalidRequest`` (field ``api_key``); 404/405/413/422 -> ``InvalidRequest``;
    429 -> :class:`CapacityError`; anything else -> :class:`RequestAborted`.
    """
    message, code, param = _parse_error(body)
    text = f"{url}: HTTP {status}: {message}"
    if status == 400 or status == 422:
        if code == "grammar_error":
            return GrammarError(text, field=param)
        if code == "context_length_exceeded":
            return ContextLengthExceeded(text, field=param)
        return InvalidRequest(text, field=param)
    if status in (401, 403):
        return InvalidRequest(f"{text} (check api_key)", field="api_key")
    if status in (404, 405):
        return InvalidRequest(f"{text} (the server does not offer this endpoint)", field=None)
    if status == 413:
        return InvalidRequest(text, field=param or "prompt")
    if status == 429:
        return CapacityError(text)
    return RequestAborted(text)


def _parse_error(body: bytes) -> tuple[str, str | None, str | None]:
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500] or "(no body)", None, None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", obj)), err.get("code"), err.get("param")
    if isinstance(obj, dict) and "message" in obj:  # FastAPI / vLLM style {"message": ..., "code": ...}
        return str(obj["message"]), None, obj.get("param")
    if isinstance(obj, dict) and "detail" in obj:
        return str(obj["detail"]), None, None
    return str(obj)[:500], None, None


class HttpClient:
    """JSON requests to one base URL (``http://host:port`` plus an optional path prefix).

    Args:
        base_url: the server's root URL.
        api_key: sent as ``Authorization: Bearer``.
        timeout: seconds for connecting and for each read.
        max_retries: retries of a 429 / 503 answer (exponential backoff from 0.25 s, at most 4 s
            a wait, or what ``Retry-After`` says).
        transport: answers requests instead of the network (see :class:`Transport`).
    """

    #: The recorder new clients start with (set it to record a whole run, construction included).
    default_recorder: list[dict[str, Any]] | None = None

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 max_retries: int = 4, verify: bool | str | None = None,
                 transport: Transport | None = None):
        parts = urllib.parse.urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parts.scheme not in ("http", "https"):
            raise InvalidRequest(f"base_url must be http:// or https://, got {base_url!r}", field="base_url")
        self.scheme = parts.scheme
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.base_url = f"{self.scheme}://{parts.netloc}{self.prefix}"
        self.timeout = timeout
        self.max_retries = max_retries
        # TLS verification as ``requests``' ``verify`` (SGLang's RuntimeEndpoint passes it there):
        # None / True: the system CAs; False: no verification; a path: that CA bundle.
        self.verify = verify
        self.headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self._local = threading.local()
        self.last_headers: dict[str, str] = {}
        self.transport = transport
        #: When a list, every exchange is appended to it (see :func:`exchange_record`).
        self.recorder: list[dict[str, Any]] | None = HttpClient.default_recorder
        self._record_lock = threading.Lock()

    def _record(self, method: str, path: str, payload: bytes | None, status: int, headers: dict[str, str],
                body: bytes, stream: bool) -> None:
        if self.recorder is not None:
            with self._record_lock:
                self.recorder.append(exchange_record(method, path, payload, status, headers, body, stream))

    # ---- connections --------------------------------------------------------------------------
    def _new_conn(self) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                               context=self._ssl_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _ssl_context(self) -> ssl.SSLContext:
        if self.verify is False:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        if isinstance(self.verify, str):
            return ssl.create_default_context(cafile=self.verify)
        return ssl.create_default_context()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._new_conn()
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def close(self) -> None:
        """Close this thread's keep-alive connection."""
        self._drop_conn()

    # ---- requests -----------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send ``body`` (JSON) and return the decoded JSON answer.

        Raises:
            ConnectionError: the server cannot be reached.
            InvalidRequest / GrammarError / ContextLengthExceeded / CapacityError /
            RequestAborted: an error answer (see :func:`error_for`).
        """
        status, headers, data = self.request_raw(method, path, body)
        if status >= 400:
            raise error_for(status, data, self.base_url + path)
        try:
            return json.loads(data) if data else None
        except ValueError as e:
            raise RequestAborted(f"{self.base_url}{path}: the answer is not JSON: {e}") from None

    def request_raw(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], bytes]:
        """Like :meth:`request` but returns ``(status, headers, body bytes)`` for every status
        (429 / 503 are still retried first)."""
        payload = None if body is None else json.dumps(body).encode()
        attempt = 0
        while True:
            status, headers, data = self._once(method, path, payload)
            if status in _RETRY_STATUSES and attempt < self.max_retries:
                time.sleep(_backoff(attempt, headers))
                attempt += 1
                continue
            self.last_headers = headers
            return status, headers, data

    def _once(self, method: str, path: str, payload: bytes | None) -> tuple[int, dict[str, str], bytes]:
        if self.transport is not None:
            status, headers, data = self.transport.send(method, path, payload, False)
        else:
            status, headers, data = self._wire(method, path, payload)
        self._record(method, path, payload, status, headers, data, False)
        return status, headers, data

    def _wire(self, method: str, path: str, payload: bytes | None) -> tuple[int, dict[str, str], bytes]:
        for fresh in (False, True):
            conn = self._conn()
            try:
                conn.request(method, self.prefix + path, body=payload, headers=self.headers)
                resp = conn.getresponse()
                data = resp.read()
                headers = {k.lower(): v for k, v in resp.getheaders()}
                if resp.will_close:
                    self._drop_conn()
                return resp.status, headers, data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                    http.client.CannotSendRequest, http.client.ResponseNotReady) as e:
                # NOTE: a keep-alive connection the server closed meanwhile; retry once on a new one.
                self._drop_conn()
                if fresh:
                    raise ConnectionError(f"{self.base_url}{path}: connection lost: {e}") from e
            except OSError as e:
                self._drop_conn()
                raise ConnectionError(f"cannot reach {self.base_url}{path}: {e}") from e
        raise AssertionError("unreachable")

    def stream(self, path: str, body: Any) -> Iterator[Any]:
        """POST ``body`` and yield each server-sent event's JSON (until ``data: [DONE]``).

        Closing the iterator closes the connection (an sgrt server then aborts the request).
        An ``{"error": ...}`` event raises as :func:`error_for` with status 500 would, unless it
        carries a 4xx-style code (then as a 400).
        """
        payload = json.dumps(body).encode()
        if self.transport is not None:
            return self._replayed_stream(path, payload)
        return self._wire_stream(path, payload)

    def _replayed_stream(self, path: str, payload: bytes) -> Iterator[Any]:
        status, headers, data = self.transport.send("POST", path, payload, True)
        self._record("POST", path, payload, status, headers, data, True)
        if status >= 400:
            raise error_for(status, data, self.base_url + path)
        lines = iter(data.splitlines(keepends=True))
        yield from self._events(lambda: next(lines, b""), path)

    def _wire_stream(self, path: str, payload: bytes) -> Iterator[Any]:
        attempt = 0
        while True:
            conn = self._new_conn()
            try:
                conn.request("POST", self.prefix + path, body=payload,
                             headers={**self.headers, "accept": "text/event-stream"})
                resp = conn.getresponse()
            except OSError as e:
                conn.close()
                raise ConnectionError(f"cannot reach {self.base_url}{path}: {e}") from e
            headers = {k.lower(): v for k, v in resp.getheaders()}
            if resp.status < 400:
                break
            data = resp.read()
            conn.close()
            self._record("POST", path, payload, resp.status, headers, data, True)
            if resp.status in _RETRY_STATUSES and attempt < self.max_retries:
                time.sleep(_backoff(attempt, headers))
                attempt += 1
                continue
            raise error_for(resp.status, data, self.base_url + path)
        seen: list[bytes] = []

        def readline() -> bytes:
            line = resp.readline()
            if self.recorder is not None:
                seen.append(line)
            return line

        try:
            yield from self._events(readline, path)
        except OSError as e:
            raise ConnectionError(f"{self.base_url}{path}: stream broken: {e}") from e
        finally:
            conn.close()
            self._record("POST", path, payload, resp.status, headers, b"".join(seen), True)

    def _events(self, readline: Any, path: str) -> Iterator[Any]:
        """Parse server-sent events from ``readline()`` (returns b"" at the end)."""
        data_lines: list[bytes] = []
        while True:
            line = readline()
            if not line:
                return
            line = line.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data_lines.append(line[5:].lstrip(b" "))
                continue
            if line or not data_lines:
                continue  # comments, other fields, keep-alive blank lines
            payload_line = b"\n".join(data_lines)
            data_lines = []
            if payload_line.strip() == b"[DONE]":
                return
            event = json.loads(payload_line)
            if isinstance(event, dict) and isinstance(event.get("error"), dict):
                code = event["error"].get("code")
                status = 400 if code in ("grammar_error", "context_length_exceeded", "invalid_value") else 500
                raise error_for(status, payload_line, self.base_url + path)
            yield event


def _backoff(attempt: int, headers: dict[str, str]) -> float:
    retry_after = headers.get("retry-after")
    if retry_after:
        try:
            return min(float(retry_after), 30.0)
        except ValueError:
            pass
    return min(0.25 * (2 ** attempt), 4.0) * (0.5 + random.random() / 2)
