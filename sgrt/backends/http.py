"""The HTTP backend: programs run against a server that speaks the OpenAI-compatible API.

``sgrt.set_default_backend(RuntimeEndpoint("http://127.0.0.1:8000"))``.

Against an **sgrt server** (detected from ``GET /v1/models``: ``owned_by == "sgrt"``) every
primitive works as with the in-process engine, through the native endpoints
(:mod:`sgrt.server.sglang.endpoints`): ``gen`` and streaming via ``/generate`` (constraints, stop
strings, logprobs, ``min_tokens``...), ``select`` by the prompt log-probabilities of
prefill-only ``/generate`` requests (the shared prompt is prefilled first, then every option
is scored in one batch), prefix hints and ``fork`` by ``/generate`` with ``max_tokens=0``, the
chat template via ``/apply_chat_template``, ``abort`` via ``/abort_request``.

Against **other OpenAI-compatible servers**, what their API allows. The dialect is what the
server says it is (``owned_by`` of ``GET /v1/models``, the ``x-sgrt-version`` header, vLLM's
``/version``, llama.cpp's ``/openapi.json`` title or ``/props``; see
:func:`sgrt.backends.dialects.detect_dialect`) or ``dialect=``: ``"vllm"``, ``"sglang"``,
``"llamacpp"``, else ``"openai"``. One adapter per dialect (:mod:`sgrt.backends.dialects`) maps
each primitive onto that engine's request fields:

- ``gen`` goes to ``/v1/completions`` with the program's text as the prompt (so the server's
  own chat template is not applied again), with the sampling extras the engine takes.
- Constraints: vLLM's ``structured_outputs`` (regex, json, Lark grammar), SGLang's ``regex`` /
  ``json_schema`` fields, ``response_format`` json_schema for llama.cpp and plain OpenAI, and
  for llama.cpp regex and Lark as an llguidance ``grammar`` where the server was built with
  llguidance (asked once per server).
- ``select`` scores the options by prompt log-probabilities: vLLM's ``prompt_logprobs``;
  llama.cpp's log-probabilities of each option's tokens forced by a token grammar; else
  ``echo`` + ``logprobs`` on ``/v1/completions``; a server that returns none is an
  ``InvalidRequest`` naming the engine and ``select``.
- Prefix hints are skipped (the servers cache prefixes themselves); the chat template comes from
  ``chat_template=`` or a local ``tokenizer=`` (a folder or an already loaded tokenizer), else a
  program that uses roles fails with an ``InvalidRequest`` that says so.
- Whatever the engine cannot do (a Lark grammar against SGLang, a regex against llama.cpp built
  without llguidance, a sampling extra
  against plain OpenAI, ``logprob_start_len`` on a ``gen``, ``truncate``) raises
  :class:`sgrt.errors.InvalidRequest` naming the engine and the primitive, before any request:
  never a silent fallback.

The class holds the connection (clients, routing, the model card, the dialect), the tokens, the
chat template, the prefix cache and control; ``gen`` lives in :mod:`sgrt.backends.http_generate`,
``select`` in :mod:`sgrt.backends.http_select`.

Errors from the server map to sgrt's types (:func:`sgrt.backends.http_client.error_for`); a
request the server aborted raises :class:`sgrt.errors.RequestAborted`.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sgrt.backends import dialects
from sgrt.backends.base import BaseBackend
from sgrt.backends.dialects import Dialect, detect_dialect
from sgrt.backends.http_client import HttpClient, Transport
from sgrt.backends.http_generate import GenerateMixin
from sgrt.backends.http_routing import ServerRouter
from sgrt.backends.http_select import SelectMixin
from sgrt.errors import InvalidRequest, RequestAborted

DIALECTS = tuple(dialects.DIALECTS)


class RuntimeEndpoint(GenerateMixin, SelectMixin, BaseBackend):
    """A DSL backend over HTTP (see the module docstring for what each server kind supports).

    Several servers of one model behind one program: ``base_url`` may be a list of roots, and
    requests keep prefix affinity. A prompt that extends one sent before (a program's next
    ``gen`` after a ``select``, a fork's branches, a chat's next turn) goes to the server that
    had that earlier prompt, whose radix cache holds it; a prompt that extends none goes to the
    server with the fewest requests in flight (ties go to the server of a prefix cached ahead
    of use, then by a hash of its first characters), so independent sessions and ``run_batch`` items
    spread out even when they share a system prompt (:class:`sgrt.backends.http_routing.ServerRouter`). Every server must serve ``model`` and be sgrt or not alike (checked when
    constructed).

    Args:
        base_url: the server's root, e.g. ``"http://127.0.0.1:8000"`` (a trailing ``/v1`` is
            accepted and dropped), or a list of such roots.
        api_key: sent as ``Authorization: Bearer``.
        verify: TLS verification for ``https://`` (SGLang's argument, ``requests``' meaning):
            ``None`` / ``True`` the system CAs, ``False`` none, a path that CA bundle.
        chat_template_name: SGLang's name of the chat template to use instead of the server's
            (``"chatml"``, ``"qwen"``, ``"llama-3-instruct"``, ``"default"``; see
            ``sgrt.lang.chat_template.get_chat_template``).
        model: the model id to request (default: the first of ``GET /v1/models``).
        dialect: ``"sgrt"``, ``"vllm"``, ``"sglang"``, ``"llamacpp"`` or ``"openai"``; detected
            from what the server says when None.
        chat_template: an explicit ``sgrt.lang.ChatTemplate``.
        tokenizer: for non-sgrt servers, a local tokenizer (a folder path, or an object with
            ``apply_chat_template``) whose chat template programs use.
        timeout: seconds per HTTP read.
        max_retries: retries of a 429 / 503 answer.
        transport: answers HTTP requests instead of the network (a replay of recorded
            exchanges in tests; see :class:`sgrt.backends.http_client.Transport`).

    Raises:
        ConnectionError: the server cannot be reached.
        InvalidRequest: a bad ``dialect`` or ``base_url``, or the server refused the API key.
    """

    def __init__(self, base_url: str | Sequence[str], api_key: str | None = None,
                 verify: bool | str | None = None, chat_template_name: str | None = None, *,
                 model: str | None = None,
                 dialect: str | None = None, chat_template: Any = None, tokenizer: Any = None,
                 timeout: float = 600.0, max_retries: int = 4, transport: Transport | None = None):
        if dialect is not None and dialect not in DIALECTS:
            raise InvalidRequest(f"dialect must be one of {DIALECTS}, got {dialect!r}", field="dialect")
        if chat_template_name is not None:
            if chat_template is not None:
                raise InvalidRequest("pass chat_template or chat_template_name, not both",
                                     field="chat_template_name")
            from sgrt.chat_template import get_chat_template

            chat_template = get_chat_template(chat_template_name)
        self.verify = verify
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise InvalidRequest("base_url: give at least one server", field="base_url")
        self.clients = [HttpClient(_strip_v1(u), api_key=api_key, timeout=timeout, max_retries=max_retries,
                                   verify=verify, transport=transport) for u in urls]
        self.router = ServerRouter(self.clients)
        self._llguidance: dict[str, bool] = {}  # server root -> built with llguidance (llama.cpp)
        self._llguidance_lock = threading.Lock()
        self.base_url = self.clients[0].base_url
        models = self.client.request("GET", "/v1/models")
        cards = (models or {}).get("data") or []
        card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
        self.model_card: dict[str, Any] = card
        self.model = model or card.get("id") or "default"
        headers = dict(self.client.last_headers)
        says_sgrt = card.get("owned_by") == "sgrt" or "x-sgrt-version" in headers
        self.dialect = dialect or detect_dialect(card.get("owned_by"), headers, self._probe)
        self.adapter: Dialect = dialects.DIALECTS[self.dialect]
        if self.dialect == "sgrt" and not says_sgrt:
            raise InvalidRequest(f"{self.base_url} is not an sgrt server (owned_by={card.get('owned_by')!r})",
                                 field="dialect")
        self._tokenizer = _load_tokenizer(tokenizer) if tokenizer is not None else None
        if chat_template is not None:
            self.chat_template = chat_template
        elif self.dialect != "sgrt" and self._tokenizer is None:
            self.chat_template = _unknown_template(self.base_url)
        for other in self.clients[1:]:
            self._check_peer(other)
        self._pool: ThreadPoolExecutor | None = None

    def _check_peer(self, other: HttpClient) -> None:
        """Another server of the list must serve the same model in the same dialect."""
        cards = (other.request("GET", "/v1/models") or {}).get("data") or []
        card = next((c for c in cards if c.get("id") == self.model), None)
        if card is None:
            raise InvalidRequest(f"base_url: {other.base_url} does not serve model {self.model!r} "
                                 f"(it serves {[c.get('id') for c in cards]})", field="base_url")
        says_sgrt = card.get("owned_by") == "sgrt" or "x-sgrt-version" in other.last_headers
        if says_sgrt != self.is_sgrt:
            raise InvalidRequest(f"base_url: {other.base_url} is {'an' if says_sgrt else 'not an'} sgrt server, "
                                 f"unlike {self.base_url}", field="base_url")

    @property
    def client(self) -> HttpClient:
        """The server this thread's current call goes to (the first one outside a call)."""
        return self.router.current()

    def client_for(self, prompt: str, remember: bool = True, hint: bool = False) -> HttpClient:
        """The server for ``prompt`` (:meth:`sgrt.backends.http_routing.ServerRouter.client_for`)."""
        return self.router.client_for(prompt, remember, hint)

    def _route(self, prompt: str) -> contextlib.AbstractContextManager[HttpClient]:
        """This thread's requests go to ``prompt``'s server until the block ends
        (:meth:`sgrt.backends.http_routing.ServerRouter.route`)."""
        return self.router.route(prompt)

    def _probe(self, path: str) -> Any:
        """GET ``path``; the JSON answer, or None for any error (detection only)."""
        try:
            status, _, data = self.client.request_raw("GET", path)
        except ConnectionError:
            return None
        if status != 200:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    @property
    def is_sgrt(self) -> bool:
        return self.dialect == "sgrt"

    @property
    def engine(self) -> str:
        """The serving engine's name, as refusals print it."""
        return self.adapter.engine

    # ---- tokens -------------------------------------------------------------------------------
    def encode(self, text: str | list[str]) -> Any:
        """Prompt ids of ``text`` (or of each text of a list) as the server encodes prompts.

        Raises:
            InvalidRequest: the server has no ``/tokenize``.
        """
        if self._tokenizer is not None and not self.is_sgrt:
            enc = self._tokenizer.encode
            return [enc(t) for t in text] if isinstance(text, list) else enc(text)
        body = {"prompt": text, "model": self.model}
        client = self.router.active() or self.client_for(
            text if isinstance(text, str) else (text[0] if text else ""), remember=False)
        out = client.request("POST", "/tokenize", body)
        if isinstance(text, list):
            return [o["tokens"] for o in out]
        return out["tokens"]

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    # ---- chat template ------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.is_sgrt:
            out = self.client.request("POST", "/apply_chat_template",
                                      {"messages": messages, "add_generation_prompt": add_generation_prompt})
            return out["text"]
        if self._tokenizer is not None:
            return self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False)
        raise InvalidRequest(f"{self.engine} at {self.base_url} does not expose its chat template; "
                             "pass RuntimeEndpoint(..., chat_template=...) or tokenizer=...", field="chat_template")

    def bos_token(self) -> str | None:
        if self.is_sgrt:
            return (self.model_card.get("sgrt") or {}).get("bos_token")
        return None

    # ---- prefix cache -------------------------------------------------------------------------
    def _prefill_ids(self, ids: list[int]) -> dict[str, Any]:
        out = self.client.request("POST", "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 0}})
        meta = out["meta_info"]
        self._native_meta(meta, time.perf_counter())
        return meta

    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        if not prompt or not self.is_sgrt:
            return {}
        out = self.client_for(prompt, hint=True).request("POST", "/generate", {"text": prompt, "sampling_params": {"max_tokens": 0}})
        meta = out["meta_info"]
        self._native_meta(meta, time.perf_counter())
        return {"prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"]}

    def commit_fork(self, prompt: str, num_branches: int) -> dict[str, Any]:
        """Cache the prompt at a ``fork`` on the server its branches will follow."""
        if len(self.clients) > 1:
            self.client_for(prompt)
        return self.cache_prefix(prompt)

    def flush_cache(self, empty_cache: bool = True) -> None:
        """POST ``/flush_cache`` to every server that has one (sgrt and SGLang; ``empty_cache``
        is sent as SGLang's body field); other servers have no such endpoint and nothing is sent."""
        if self.adapter.native_cache:
            for client in self.clients:
                client.request("POST", "/flush_cache", {"empty_cache": bool(empty_cache)})

    # ---- control ------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        if self.adapter.native_cache:
            for client in self.clients:  # NOTE: only the server that runs it knows the id
                try:
                    client.request("POST", "/abort_request", {"rid": request_id})
                except (InvalidRequest, RequestAborted, ConnectionError):
                    pass  # best effort: the request may be gone, or the server may not know it

    @property
    def url(self) -> str:
        """The server's root URL (SGLang's ``base_url``; also under SGLang's ``Runtime.url``)."""
        return self.base_url

    @property
    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info`` keys, from the server's model card: ``model_path`` (the
        sgrt server's model path when it says, else the model id), ``tokenizer_path``,
        ``is_generation``, ``has_image_understanding``."""
        extra = self.model_card.get("sgrt") or {}
        path = extra.get("model_path") or self.model_card.get("root") or self.model
        return {"model_path": path, "tokenizer_path": path, "is_generation": True,
                "has_image_understanding": False, "has_audio_understanding": False}

    def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {**self.model_info, "backend": type(self).__name__,
                                "base_url": self.base_url, "base_urls": [c.base_url for c in self.clients],
                                "model": self.model, "dialect": self.dialect, "engine": self.engine,
                                "model_card": self.model_card}
        if self.is_sgrt:
            try:
                info["health"] = self.client.request("GET", "/health")
            except Exception:  # noqa: BLE001 - info is best effort
                pass
        return info

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="sgrt-http")
        return self._pool

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        for client in self.clients:
            client.close()

    def __enter__(self) -> "RuntimeEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r}, model={self.model!r}, dialect={self.dialect!r})"

    def _require_llguidance(self, key: str) -> None:
        """Refuse ``key`` (a primitive) unless the current server was built with llguidance.

        llama.cpp: asked once per server by a ``/completion`` of no tokens with a JSON Schema
        (``{"const": 1}``): a build with llguidance compiles it to a grammar that starts with
        ``%llguidance`` and shows it in ``generation_settings.grammar``; a build without it
        gives GBNF (and would abort the process on an ``%llguidance`` grammar, so none is sent).

        Raises:
            InvalidRequest: (``field`` = ``key``) the server is not known to have llguidance.
        """
        client = self.client
        with self._llguidance_lock:
            known = self._llguidance.get(client.base_url)
        if known is None:
            try:
                out = client.request("POST", "/completion", {"prompt": "", "n_predict": 0,
                                                             "json_schema": {"const": 1}})
                grammar = str(((out or {}).get("generation_settings") or {}).get("grammar") or "")
                known = grammar.startswith("%llguidance")
            except (InvalidRequest, RequestAborted, ConnectionError):
                known = False
            with self._llguidance_lock:
                self._llguidance[client.base_url] = known
        if not known:
            raise self.adapter.refuse(key, client.base_url, "it needs a server built with llguidance "
                                      "(LLAMA_LLGUIDANCE=ON, as xllamacpp's wheels are), and this one did not "
                                      "show it (its JSON Schema grammar is not %llguidance)")


def _strip_v1(url: str) -> str:
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _load_tokenizer(tokenizer: Any) -> Any:
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError here
        raise InvalidRequest(f"cannot load a tokenizer from {tokenizer!r}: {e}", field="tokenizer") from None


def _unknown_template(base_url: str) -> Any:
    """A chat template whose roles fail with a clear error: programs without roles still run."""
    from sgrt.chat_template import ChatTemplate

    class UnknownChatTemplate(ChatTemplate):
        def prefix_and_suffix(self, role: str) -> tuple[str, str]:
            raise InvalidRequest(
                f"the server at {base_url} does not expose its chat template, so role {role!r} cannot be "
                "rendered; pass RuntimeEndpoint(..., chat_template=...) or tokenizer=...", field="chat_template")

    return UnknownChatTemplate(name=f"unknown ({base_url})")
