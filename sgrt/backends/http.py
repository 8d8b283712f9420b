"""The HTTP backend: programs run against a server that speaks the OpenAI-compatible API.

``sgrt.set_default_backend(RuntimeEndpoint("http://127.0.0.1:8000"))``.

Against an **sgrt server** (detected from ``GET /v1/models``: ``owned_by == "sgrt"``) every
primitive works as with the in-process engine, through the native endpoints
(:mod:`sgrt.server.http_native`): ``gen`` and streaming via ``/generate`` (constraints, stop
strings, logprobs, ``min_tokens``...), ``select`` by the prompt log-probabilities of
prefill-only ``/generate`` requests (the shared prompt is prefilled first, then every option
is scored in one batch), prefix hints and ``fork`` by ``/generate`` with ``max_tokens=0``, the
chat template via ``/apply_chat_template``, ``abort`` via ``/abort_request``.

Against **other OpenAI-compatible servers**, what their API allows, by ``dialect`` (detected
from ``owned_by``: ``"vllm"``, ``"sglang"``, else ``"openai"``):

- ``gen`` goes to ``/v1/completions`` with the program's text as the prompt (so the server's
  own chat template is not applied again). ``top_k``, ``min_p``, ``min_tokens``,
  ``repetition_penalty``, ``stop_token_ids`` and ``ignore_eos`` are sent as the extra fields
  vLLM and SGLang accept.
- Constraints: ``json_schema`` as ``response_format`` (``openai``), as SGLang's ``json_schema``
  extra field, or as vLLM's ``structured_outputs.json``; ``regex`` as SGLang's ``regex`` or
  vLLM's ``structured_outputs.regex``; ``grammar`` (Lark) only through vLLM's
  ``structured_outputs.grammar``.
- ``select`` scores the options by their prompt log-probabilities from ``echo`` + ``logprobs``
  on ``/v1/completions`` (``max_tokens=0``, or 1 if the server refuses 0); a server that refuses
  echo gets a clear error.
- Prefix hints are skipped (the servers cache prefixes themselves); the chat template comes from
  ``chat_template=`` or a local ``tokenizer=`` (a folder or an already loaded tokenizer), else a
  program that uses roles fails with an ``InvalidRequest`` that says so.
- What the dialect cannot do (``regex`` against plain OpenAI, a Lark ``grammar`` against SGLang,
  ``logprob_start_len`` on a ``gen``, ``truncate``) raises :class:`sgrt.errors.InvalidRequest`
  naming the field and the server.

Errors from the server map to sgrt's types (:func:`sgrt.backends.http_client.error_for`); a
request the server aborted raises :class:`sgrt.errors.RequestAborted`.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sgrt.backends.base import (
    BaseBackend,
    ChoiceScore,
    GenChunk,
    GenOutput,
    common_prefix_len,
    next_token_request,
    split_stop_regex,
    stop_stream_at_regex,
    strip_next_token,
)
from sgrt.backends.http_client import HttpClient
from sgrt.errors import InvalidRequest, RequestAborted

DIALECTS = ("sgrt", "vllm", "sglang", "openai")

#: Sampling fields sent as vLLM / SGLang extra fields when not at their defaults.
_EXTRA_DEFAULTS = {"top_k": -1, "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0,
                   "stop_token_ids": [], "ignore_eos": False}
#: Engine-side hints another server has no use for: dropped silently.
_HINTS = ("jump_forward", "speculative", "num_draft_tokens", "grammar_backend")


def schema_dict(spec: Any) -> Any:
    """A ``json_schema`` value as a JSON Schema dict: a dict or bool as is, JSON text parsed, a
    Pydantic model / msgspec Struct / dataclass type converted.

    Raises:
        InvalidRequest: (field ``json_schema``) anything else.
    """
    if isinstance(spec, (dict, bool)):
        return spec
    if isinstance(spec, (str, bytes)):
        try:
            return json.loads(spec)
        except ValueError as e:
            raise InvalidRequest(f"json_schema is not valid JSON: {e}", field="json_schema") from None
    if isinstance(spec, type):
        if hasattr(spec, "model_json_schema"):
            return spec.model_json_schema()
        import msgspec

        if issubclass(spec, msgspec.Struct) or dataclasses.is_dataclass(spec):
            return msgspec.json.schema(spec)
    raise InvalidRequest(f"json_schema must be a dict, JSON text, a Pydantic model, a msgspec Struct or a "
                         f"dataclass, got {type(spec).__name__}", field="json_schema")


def _jsonable(params: dict[str, Any]) -> dict[str, Any]:
    out = dict(params)
    if out.get("json_schema") is not None:
        out["json_schema"] = schema_dict(out["json_schema"])
    return out


class RuntimeEndpoint(BaseBackend):
    """A DSL backend over HTTP (see the module docstring for what each server kind supports).

    Args:
        base_url: the server's root, e.g. ``"http://127.0.0.1:8000"`` (a trailing ``/v1`` is
            accepted and dropped).
        api_key: sent as ``Authorization: Bearer``.
        verify: TLS verification for ``https://`` (SGLang's argument, ``requests``' meaning):
            ``None`` / ``True`` the system CAs, ``False`` none, a path that CA bundle.
        chat_template_name: SGLang's name of the chat template to use instead of the server's
            (``"chatml"``, ``"qwen"``, ``"llama-3-instruct"``, ``"default"``; see
            ``sgrt.lang.chat_template.get_chat_template``).
        model: the model id to request (default: the first of ``GET /v1/models``).
        dialect: ``"sgrt"``, ``"vllm"``, ``"sglang"`` or ``"openai"``; detected when None.
        chat_template: an explicit ``sgrt.lang.ChatTemplate``.
        tokenizer: for non-sgrt servers, a local tokenizer (a folder path, or an object with
            ``apply_chat_template``) whose chat template programs use.
        timeout: seconds per HTTP read.
        max_retries: retries of a 429 / 503 answer.

    Raises:
        ConnectionError: the server cannot be reached.
        InvalidRequest: a bad ``dialect`` or ``base_url``, or the server refused the API key.
    """

    def __init__(self, base_url: str, api_key: str | None = None, verify: bool | str | None = None,
                 chat_template_name: str | None = None, *, model: str | None = None,
                 dialect: str | None = None, chat_template: Any = None, tokenizer: Any = None,
                 timeout: float = 600.0, max_retries: int = 4):
        if dialect is not None and dialect not in DIALECTS:
            raise InvalidRequest(f"dialect must be one of {DIALECTS}, got {dialect!r}", field="dialect")
        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        if chat_template_name is not None:
            if chat_template is not None:
                raise InvalidRequest("pass chat_template or chat_template_name, not both",
                                     field="chat_template_name")
            from sgrt.lang.chat_template import get_chat_template

            chat_template = get_chat_template(chat_template_name)
        self.verify = verify
        self.client = HttpClient(base, api_key=api_key, timeout=timeout, max_retries=max_retries,
                                 verify=verify)
        self.base_url = self.client.base_url
        models = self.client.request("GET", "/v1/models")
        cards = (models or {}).get("data") or []
        card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
        self.model_card: dict[str, Any] = card
        self.model = model or card.get("id") or "default"
        detected = "sgrt" if (card.get("owned_by") == "sgrt" or "x-sgrt-version" in self.client.last_headers) \
            else {"vllm": "vllm", "sglang": "sglang"}.get(str(card.get("owned_by", "")).lower(), "openai")
        self.dialect = dialect or detected
        if self.dialect == "sgrt" and detected != "sgrt":
            raise InvalidRequest(f"{self.base_url} is not an sgrt server (owned_by={card.get('owned_by')!r})",
                                 field="dialect")
        self._tokenizer = _load_tokenizer(tokenizer) if tokenizer is not None else None
        if chat_template is not None:
            self.chat_template = chat_template
        elif self.dialect != "sgrt" and self._tokenizer is None:
            self.chat_template = _unknown_template(self.base_url)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def is_sgrt(self) -> bool:
        return self.dialect == "sgrt"

    def _refuse(self, what: str, field: str | None) -> InvalidRequest:
        return InvalidRequest(f"{what} is not supported by the {self.dialect} server at {self.base_url}",
                              field=field)

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
        out = self.client.request("POST", "/tokenize", body)
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
        raise InvalidRequest(f"the {self.dialect} server at {self.base_url} does not expose its chat template; "
                             "pass RuntimeEndpoint(..., chat_template=...) or tokenizer=...", field="chat_template")

    def bos_token(self) -> str | None:
        if self.is_sgrt:
            return (self.model_card.get("sgrt") or {}).get("bos_token")
        return None

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompt: str, params: dict[str, Any], request_id: str | None = None) -> GenOutput:
        """Complete ``prompt``; SGLang's ``stop_regex`` is applied here while the tokens stream in
        (the request is closed at the match), and its ``max_tokens=0`` next-token idiom becomes a
        one-token request (``sgrt.backends.base.next_token_request``)."""
        params, patterns = split_stop_regex(params)
        params, next_only = next_token_request(params)
        if patterns and not next_only:
            chunks = list(self._regex_stream(prompt, params, request_id, patterns))
            return GenOutput("".join(c.text for c in chunks), chunks[-1].meta_info or {})
        out = self._generate(prompt, params, request_id)
        if next_only:
            return GenOutput("", strip_next_token(out.meta_info))
        return out

    def _regex_stream(self, prompt: str, params: dict[str, Any], request_id: str | None,
                      patterns: list) -> Iterator[GenChunk]:
        start = time.perf_counter()

        def stopped_meta(text: str, n_tokens: int, pattern: str) -> dict[str, Any]:
            try:
                prompt_tokens = self.count_tokens(prompt)
            except InvalidRequest:
                prompt_tokens = None
            return {"id": request_id, "prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                    "cached_tokens": None, "finish_reason": "stop", "matched": pattern,
                    "e2e_latency": time.perf_counter() - start, "ttft": None, "incomplete": False,
                    "warnings": []}

        return stop_stream_at_regex(self._generate_stream(prompt, params, request_id), patterns,
                                    stopped_meta)

    def _generate(self, prompt: str, params: dict[str, Any], request_id: str | None = None) -> GenOutput:
        start = time.perf_counter()
        if self.is_sgrt:
            body = {"text": prompt, "sampling_params": _jsonable(params), "return_text_in_logprobs": True}
            if request_id is not None:
                body["rid"] = request_id
            out = self.client.request("POST", "/generate", body)
            return GenOutput(out["text"], self._native_meta(out["meta_info"], start))
        body = self._completion_body(prompt, params, request_id)
        out = self.client.request("POST", "/v1/completions", body)
        return self._completion_output(out, start)

    def generate_batch(self, prompts: Sequence[str], params: Sequence[dict[str, Any]]) -> list[GenOutput]:
        """One ``/generate`` batch against sgrt (the requests batch in the engine); concurrent
        requests otherwise."""
        if not prompts:
            return []
        if any(p.get("stop_regex") or next_token_request(p)[1] for p in params):
            pool = self._executor()
            return [f.result() for f in [pool.submit(self.generate, p, sp) for p, sp in zip(prompts, params)]]
        if self.is_sgrt:
            start = time.perf_counter()
            body = {"text": list(prompts), "sampling_params": [_jsonable(split_stop_regex(p)[0]) for p in params],
                    "return_text_in_logprobs": True}
            outs = self.client.request("POST", "/generate", body)
            return [GenOutput(o["text"], self._native_meta(o["meta_info"], start)) for o in outs]
        pool = self._executor()
        futures = [pool.submit(self.generate, p, sp) for p, sp in zip(prompts, params)]
        return [f.result() for f in futures]

    def generate_stream(self, prompt: str, params: dict[str, Any],
                        request_id: str | None = None) -> Iterator[GenChunk]:
        params, patterns = split_stop_regex(params)
        params, next_only = next_token_request(params)
        if next_only:
            return iter([GenChunk("", [], None, None, True, self.generate(
                prompt, {**params, "max_tokens": 0}, request_id).meta_info)])
        if patterns:
            return self._regex_stream(prompt, params, request_id, patterns)
        return self._generate_stream(prompt, params, request_id)

    def _generate_stream(self, prompt: str, params: dict[str, Any],
                         request_id: str | None = None) -> Iterator[GenChunk]:
        start = time.perf_counter()
        if self.is_sgrt:
            body = {"text": prompt, "sampling_params": _jsonable(params), "return_text_in_logprobs": True,
                    "stream": True}
            if request_id is not None:
                body["rid"] = request_id
            return self._native_stream(body, start)
        body = self._completion_body(prompt, params, request_id)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return self._completion_stream(body, start)

    def _native_stream(self, body: dict[str, Any], start: float) -> Iterator[GenChunk]:
        events = self.client.stream("/generate", body)
        try:
            for ev in events:
                lps = _tuples(ev.get("output_token_logprobs"))
                tops = [_tuples(row) for row in ev["output_top_logprobs"]] if ev.get("output_top_logprobs") else None
                meta = self._native_meta(ev["meta_info"], start) if ev.get("finished") else None
                yield GenChunk(ev.get("text", ""), list(ev.get("token_ids") or []), lps, tops,
                               bool(ev.get("finished")), meta)
                if ev.get("finished"):
                    return
            raise RequestAborted(f"{self.base_url}/generate: the stream ended without a result")
        finally:
            events.close()

    def _native_meta(self, meta: dict[str, Any], start: float) -> dict[str, Any]:
        if meta.get("finish_reason") == "abort":
            raise RequestAborted(f"request {meta.get('id')} aborted: {meta.get('error') or 'no reason given'}")
        out = dict(meta)
        out["e2e_latency"] = time.perf_counter() - start
        if "output_token_logprobs" in out:
            out["output_token_logprobs"] = _tuples(out["output_token_logprobs"])
        if "output_top_logprobs" in out:
            out["output_top_logprobs"] = [_tuples(row) for row in out["output_top_logprobs"]]
        for key in ("input_token_logprobs", "input_top_logprobs", "error"):
            out.pop(key, None)
        return out

    # ---- OpenAI-compatible completions (other servers) ----------------------------------------
    def _completion_body(self, prompt: str | list[str], params: dict[str, Any],
                         request_id: str | None) -> dict[str, Any]:
        p = dict(params)
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "n": 1,
                                "max_tokens": p.pop("max_tokens", 128),
                                "temperature": p.pop("temperature", 0.0)}
        for key in ("top_p", "seed", "frequency_penalty", "presence_penalty"):
            if p.get(key) is not None:
                body[key] = p[key]
            p.pop(key, None)
        stop = p.pop("stop", None) or []
        if stop:
            body["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if p.pop("return_logprob", False):
            body["logprobs"] = int(p.get("top_logprobs_num") or 0)
            if self.dialect == "vllm":
                body["return_tokens_as_token_ids"] = True
        p.pop("top_logprobs_num", None)
        if p.pop("logprob_start_len", -1) not in (-1, None):
            raise self._refuse("logprob_start_len on a gen", "logprob_start_len")
        if p.pop("truncate", None) is not None:
            raise self._refuse("truncate", "truncate")
        skip = p.pop("skip_special_tokens", True)
        for key in _HINTS:
            p.pop(key, None)
        for key, default in _EXTRA_DEFAULTS.items():
            value = p.pop(key, default)
            if value is None or value == default:
                continue
            if self.dialect == "openai":
                raise self._refuse(key, key)
            body[key] = value
        if not skip and self.dialect != "openai":
            body["skip_special_tokens"] = False
        self._constraints(body, p.pop("regex", None), p.pop("json_schema", None), p.pop("grammar", None))
        if self.dialect == "sglang" and request_id is not None:
            body["rid"] = request_id
        unknown = sorted(k for k, v in p.items() if v is not None)
        if unknown:
            raise self._refuse(f"sampling field {unknown[0]!r}", unknown[0])
        return body

    def _constraints(self, body: dict[str, Any], regex: str | None, json_schema: Any, grammar: str | None) -> None:
        schema = None if json_schema is None else schema_dict(json_schema)
        if self.dialect == "vllm":
            so = {k: v for k, v in (("regex", regex), ("json", schema), ("grammar", grammar)) if v is not None}
            if so:
                body["structured_outputs"] = so
            return
        if grammar is not None:
            raise self._refuse("a Lark grammar constraint", "grammar")
        if self.dialect == "sglang":
            if regex is not None:
                body["regex"] = regex
            if schema is not None:
                body["json_schema"] = json.dumps(schema)
            return
        if regex is not None:
            raise self._refuse("a regex constraint", "regex")
        if schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}

    def _completion_output(self, out: dict[str, Any], start: float) -> GenOutput:
        choice = (out.get("choices") or [{}])[0]
        meta = self._completion_meta(out, choice, start, ttft=None)
        lp = choice.get("logprobs")
        if lp:
            lps, tops = self._legacy_logprobs(lp)
            meta["output_token_logprobs"] = lps
            if tops is not None:
                meta["output_top_logprobs"] = tops
            meta["output_token_ids"] = [t for _, t, _ in lps]
        return GenOutput(choice.get("text", ""), meta)

    def _completion_meta(self, out: dict[str, Any], choice: dict[str, Any], start: float,
                         ttft: float | None) -> dict[str, Any]:
        reason = choice.get("finish_reason")
        if reason == "abort":
            raise RequestAborted(f"request {out.get('id')} aborted by {self.base_url}")
        usage = out.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {
            "id": out.get("id"),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": details.get("cached_tokens") or 0,
            "finish_reason": "length" if reason == "length" else "stop",
            "matched": choice.get("stop_reason", choice.get("matched_stop")),
            "e2e_latency": time.perf_counter() - start,
            "ttft": ttft,
            "incomplete": False,
            "warnings": [],
            "output_token_ids": [],
        }

    def _legacy_logprobs(self, lp: dict[str, Any]) -> tuple[list[tuple], list[list[tuple]] | None]:
        tokens = lp.get("tokens") or []
        lps = [(v, self._token_id(t), t) for v, t in zip(lp.get("token_logprobs") or [], tokens)]
        tops = None
        if lp.get("top_logprobs"):
            tops = [[(v, self._token_id(t), t) for t, v in (row or {}).items()] for row in lp["top_logprobs"]]
        return lps, tops

    def _token_id(self, token: str) -> int | None:
        # NOTE: only vLLM (return_tokens_as_token_ids) tells the ids; others give text only.
        if token.startswith("token_id:"):
            try:
                return int(token[9:])
            except ValueError:
                return None
        return None

    def _completion_stream(self, body: dict[str, Any], start: float) -> Iterator[GenChunk]:
        events = self.client.stream("/v1/completions", body)
        ttft = None
        last: dict[str, Any] = {}
        choice_end: dict[str, Any] = {}
        usage_event: dict[str, Any] = {}
        try:
            for ev in events:
                if ev.get("usage"):
                    usage_event = ev
                for choice in ev.get("choices") or []:
                    text = choice.get("text") or ""
                    lps = tops = None
                    if choice.get("logprobs"):
                        lps, tops = self._legacy_logprobs(choice["logprobs"])
                    if text or lps:
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        ids = [t for _, t, _ in lps] if lps else []
                        yield GenChunk(text, ids, lps, tops, False, None)
                    if choice.get("finish_reason"):
                        choice_end = choice
                last = ev
        finally:
            events.close()
        if not choice_end:
            raise RequestAborted(f"{self.base_url}/v1/completions: the stream ended without a finish reason")
        merged = {**last, "usage": usage_event.get("usage") or last.get("usage")}
        yield GenChunk("", [], None, None, True, self._completion_meta(merged, choice_end, start, ttft))

    # ---- select -------------------------------------------------------------------------------
    def score_choices(self, prompt: str, choices: Sequence[str], unconditional: bool = False) -> list[ChoiceScore]:
        """sgrt: prefill ``prompt`` once, then score every option (and, with ``unconditional``,
        every option alone) in one batch of prefill-only ``/generate`` requests, aligned as
        :meth:`sgrt.backends.local.LocalBackend.score_choices` aligns them. Other servers:
        ``echo`` + ``logprobs`` on ``/v1/completions``."""
        if not self.is_sgrt:
            return self._score_by_echo(prompt, choices, unconditional)
        texts = [prompt] + [prompt + c for c in choices] + (list(choices) if unconditional else [])
        ids = self.encode(texts)
        prefix_ids, full = ids[0], ids[1:1 + len(choices)]
        alone = ids[1 + len(choices):]
        self._prefill_ids(prefix_ids)
        starts = [min(common_prefix_len(prefix_ids, f), len(f) - 1) for f in full]
        body = {"input_ids": full + alone, "sampling_params": {"max_tokens": 0}, "return_logprob": True,
                "logprob_start_len": starts + [1] * len(alone), "return_text_in_logprobs": True}
        outs = self.client.request("POST", "/generate", body)
        scores = []
        for choice, out in zip(choices, outs[:len(choices)]):
            meta = out["meta_info"]
            self._native_meta(meta, time.perf_counter())  # raises for an abort
            pairs = [(lp, t, txt) for lp, t, txt in meta.get("input_token_logprobs") or [] if lp is not None]
            scores.append(ChoiceScore(choice=choice, token_ids=[t for _, t, _ in pairs],
                                      token_logprobs=[lp for lp, _, _ in pairs],
                                      token_texts=[txt for _, _, txt in pairs],
                                      prompt_tokens=meta["prompt_tokens"], cached_tokens=meta["cached_tokens"]))
        for sc, out in zip(scores, outs[len(choices):]):
            # NOTE: scored from position 1 (position 0 has no context, its entry is None).
            lps = [None] + [lp for lp, _, _ in out["meta_info"].get("input_token_logprobs") or []]
            # NOTE: aligned like LocalBackend: the option's own tokenization, cut or padded.
            n = len(sc.token_logprobs)
            sc.unconditional_logprobs = lps[:n] + [None] * max(0, n - len(lps))
        return scores

    def _score_by_echo(self, prompt: str, choices: Sequence[str], unconditional: bool) -> list[ChoiceScore]:
        full = self._echo_logprobs([prompt + c for c in choices], "select")
        scores = []
        for choice, (tokens, lps, offsets, n_prompt) in zip(choices, full):
            k = next((i for i, (off, tok) in enumerate(zip(offsets, tokens)) if off + len(tok) > len(prompt)),
                     len(tokens))
            k = max(min(k, len(tokens) - 1), 1 if len(tokens) > 1 else 0)
            pairs = [(lp, tok) for lp, tok in zip(lps[k:], tokens[k:]) if lp is not None]
            scores.append(ChoiceScore(choice=choice, token_ids=[self._token_id(t) for _, t in pairs],
                                      token_logprobs=[lp for lp, _ in pairs], token_texts=[t for _, t in pairs],
                                      prompt_tokens=n_prompt, cached_tokens=0))
        if unconditional:
            for sc, (_, lps, _, _) in zip(scores, self._echo_logprobs(list(choices), "select")):
                n = len(sc.token_logprobs)
                sc.unconditional_logprobs = list(lps[:n]) + [None] * max(0, n - len(lps))
        return scores

    def _echo_logprobs(self, texts: list[str], what: str) -> list[tuple[list[str], list, list[int], int]]:
        """Per text: (tokens, logprobs, text offsets, prompt token count) of the prompt itself."""
        body = {"model": self.model, "prompt": texts, "max_tokens": 0, "echo": True, "logprobs": 0,
                "temperature": 0.0}
        try:
            try:
                out = self.client.request("POST", "/v1/completions", body)
                generated = 0
            except InvalidRequest as e:
                if e.field != "max_tokens" and "max_tokens" not in str(e):
                    raise
                out = self.client.request("POST", "/v1/completions", {**body, "max_tokens": 1})
                generated = 1
        except InvalidRequest as e:
            raise InvalidRequest(f"{what} needs prompt log-probabilities (echo + logprobs on /v1/completions), "
                                 f"which the {self.dialect} server at {self.base_url} refused: {e}",
                                 field="select") from None
        results = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(results) != len(texts):
            raise InvalidRequest(f"{what}: the server answered {len(results)} choices for {len(texts)} prompts",
                                 field="select")
        rows = []
        for choice in results:
            lp = choice.get("logprobs") or {}
            tokens = list(lp.get("tokens") or [])
            values = list(lp.get("token_logprobs") or [])
            offsets = list(lp.get("text_offset") or [])
            if generated:
                tokens, values, offsets = tokens[:-1], values[:-1], offsets[:-1]
            if not tokens or len(offsets) != len(tokens):
                raise InvalidRequest(f"{what} needs prompt log-probabilities, and the {self.dialect} server at "
                                     f"{self.base_url} returned none for echo", field="select")
            rows.append((tokens, values, offsets, len(tokens)))
        return rows

    # ---- prefix cache -------------------------------------------------------------------------
    def _prefill_ids(self, ids: list[int]) -> dict[str, Any]:
        out = self.client.request("POST", "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 0}})
        meta = out["meta_info"]
        self._native_meta(meta, time.perf_counter())
        return meta

    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        if not prompt or not self.is_sgrt:
            return {}
        out = self.client.request("POST", "/generate", {"text": prompt, "sampling_params": {"max_tokens": 0}})
        meta = out["meta_info"]
        self._native_meta(meta, time.perf_counter())
        return {"prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"]}

    def flush_cache(self, empty_cache: bool = True) -> None:
        """POST ``/flush_cache`` (sgrt and SGLang servers; ``empty_cache`` is sent as SGLang's
        body field); other servers have no such endpoint and nothing is sent."""
        if self.dialect in ("sgrt", "sglang"):
            self.client.request("POST", "/flush_cache", {"empty_cache": bool(empty_cache)})

    # ---- control ------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        if self.dialect in ("sgrt", "sglang"):
            try:
                self.client.request("POST", "/abort_request", {"rid": request_id})
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
                                "base_url": self.base_url, "model": self.model,
                                "dialect": self.dialect, "model_card": self.model_card}
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
        self.client.close()

    def __enter__(self) -> "RuntimeEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r}, model={self.model!r}, dialect={self.dialect!r})"


def _tuples(rows: Any) -> list[tuple] | None:
    if rows is None:
        return None
    return [tuple(r) for r in rows]


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
    from sgrt.lang.chat_template import ChatTemplate

    class UnknownChatTemplate(ChatTemplate):
        def prefix_and_suffix(self, role: str) -> tuple[str, str]:
            raise InvalidRequest(
                f"the server at {base_url} does not expose its chat template, so role {role!r} cannot be "
                "rendered; pass RuntimeEndpoint(..., chat_template=...) or tokenizer=...", field="chat_template")

    return UnknownChatTemplate(name=f"unknown ({base_url})")
