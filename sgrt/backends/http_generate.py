"""``gen`` for :class:`sgrt.backends.http.RuntimeEndpoint`: sgrt's native ``/generate`` (complete,
batched, streamed) or an OpenAI-compatible ``/v1/completions`` whose body the endpoint's
dialect (:mod:`sgrt.backends.dialects`) writes; SGLang's ``stop_regex`` and next-token idiom
applied on this side; the answers read back into :class:`GenOutput` / :class:`GenChunk`."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from sgrt.backends.base import (
    GenChunk,
    GenOutput,
    ParamsLike,
    as_sampling_params,
    next_token_request,
    split_stop_regex,
    stop_stream_at_regex,
    strip_next_token,
)
from sgrt.backends.dialects import schema_dict
from sgrt.backends.http_client import HttpClient
from sgrt.errors import InvalidRequest, RequestAborted
from sgrt.sampling_params import SamplingParams


def _jsonable(params: SamplingParams) -> dict[str, Any]:
    """``params`` as sgrt's ``/generate`` ``sampling_params`` (JSON: a schema read into a dict)."""
    out = params.to_wire_dict()
    if out.get("json_schema") is not None:
        out["json_schema"] = schema_dict(out["json_schema"])
    return out


def _tuples(rows: Any) -> list[tuple] | None:
    if rows is None:
        return None
    return [tuple(r) for r in rows]


class GenerateMixin:
    """The generation methods of :class:`~sgrt.backends.http.RuntimeEndpoint` (which holds the
    clients, the dialect adapter and the routing they use)."""

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompt: str, params: ParamsLike, request_id: str | None = None) -> GenOutput:
        """Complete ``prompt``; SGLang's ``stop_regex`` is applied here while the tokens stream in
        (the request is closed at the match), and its ``max_tokens=0`` next-token idiom becomes a
        one-token request (``sgrt.backends.base.next_token_request``)."""
        with self._route(prompt):
            return self._generate_routed(prompt, params, request_id)

    def _generate_routed(self, prompt: str, params: ParamsLike, request_id: str | None) -> GenOutput:
        params, patterns = split_stop_regex(params)
        params, next_only = next_token_request(params)
        if patterns and not next_only:
            chunks = list(self._regex_stream(prompt, params, request_id, patterns))
            return GenOutput("".join(c.text for c in chunks), chunks[-1].meta_info or {})
        out = self._generate(prompt, params, request_id)
        if next_only:
            return GenOutput("", strip_next_token(out.meta_info))
        return out

    def _regex_stream(self, prompt: str, params: SamplingParams, request_id: str | None,
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

    def _generate(self, prompt: str, params: SamplingParams, request_id: str | None = None) -> GenOutput:
        start = time.perf_counter()
        if self.is_sgrt:
            body = {"text": prompt, "sampling_params": _jsonable(params), "return_text_in_logprobs": True}
            if request_id is not None:
                body["rid"] = request_id
            out = self.client.request("POST", "/generate", body)
            return GenOutput(out["text"], self._native_meta(out["meta_info"], start))
        body = self._completion_body(prompt, params, request_id)
        out = self.client.request("POST", "/v1/completions", body)
        return self._completion_output(out, start, tops=bool(params.top_logprobs_num))

    def generate_batch(self, prompts: Sequence[str], params: Sequence[ParamsLike]) -> list[GenOutput]:
        """One ``/generate`` batch against sgrt (the requests batch in the engine); concurrent
        requests otherwise."""
        if not prompts:
            return []
        params = [as_sampling_params(p) for p in params]
        if any(p.stop_regex or next_token_request(p)[1] for p in params):
            pool = self._executor()
            return [f.result() for f in [pool.submit(self.generate, p, sp) for p, sp in zip(prompts, params)]]
        if self.is_sgrt and len(self.clients) == 1:
            start = time.perf_counter()
            body = {"text": list(prompts), "sampling_params": [_jsonable(p) for p in params],
                    "return_text_in_logprobs": True}
            outs = self.client.request("POST", "/generate", body)
            return [GenOutput(o["text"], self._native_meta(o["meta_info"], start)) for o in outs]
        pool = self._executor()
        futures = [pool.submit(self.generate, p, sp) for p, sp in zip(prompts, params)]
        return [f.result() for f in futures]

    def generate_stream(self, prompt: str, params: ParamsLike,
                        request_id: str | None = None) -> Iterator[GenChunk]:
        params, patterns = split_stop_regex(params)
        params, next_only = next_token_request(params)
        if next_only:
            return self.next_token_stream(prompt, params, request_id)
        if patterns:
            return self._regex_stream(prompt, params, request_id, patterns)
        return self._generate_stream(prompt, params, request_id)

    def _generate_stream(self, prompt: str, params: SamplingParams,
                         request_id: str | None = None) -> Iterator[GenChunk]:
        start = time.perf_counter()
        if self.is_sgrt:
            body = {"text": prompt, "sampling_params": _jsonable(params), "return_text_in_logprobs": True,
                    "stream": True}
            if request_id is not None:
                body["rid"] = request_id
            return self._native_stream(body, start, self.client_for(prompt))
        body = self._completion_body(prompt, params, request_id)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return self._completion_stream(body, start, self.client_for(prompt),
                                       keep_tops=bool(params.top_logprobs_num))

    def _native_stream(self, body: dict[str, Any], start: float, client: HttpClient) -> Iterator[GenChunk]:
        events = client.stream("/generate", body)
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
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key in out:
                out[key] = _tuples(out[key])
        for key in ("output_top_logprobs", "input_top_logprobs"):
            if key in out:
                out[key] = [_tuples(row) for row in out[key]]
        out.pop("error", None)
        return out

    # ---- OpenAI-compatible completions (other servers) ----------------------------------------
    def _completion_body(self, prompt: str | list[str], params: ParamsLike,
                         request_id: str | None) -> dict[str, Any]:
        params = as_sampling_params(params)
        body = self.adapter.completion_body(self.model, prompt, params, request_id, self.base_url)
        for key in ("regex", "grammar"):
            if getattr(params, key) is not None and key in self.adapter.needs_llguidance:
                self._require_llguidance(key)
        return body

    def _completion_output(self, out: dict[str, Any], start: float, tops: bool = True) -> GenOutput:
        """``tops``: keep top logprobs (False drops those a server sends unasked: llama.cpp
        needs ``logprobs`` >= 1 to return any)."""
        choice = (out.get("choices") or [{}])[0]
        meta = self._completion_meta(out, choice, start, ttft=None)
        lp = choice.get("logprobs")
        if lp:
            lps, top_rows = self._legacy_logprobs(lp)
            meta["output_token_logprobs"] = lps
            if top_rows is not None and tops:
                meta["output_top_logprobs"] = top_rows
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
        if isinstance(lp.get("content"), list):
            # NOTE: llama.cpp answers /v1/completions logprobs in the chat form, with token ids.
            rows = lp["content"]
            lps = [(e.get("logprob"), e.get("id"), e.get("token", "")) for e in rows]
            tops = [[(t.get("logprob"), t.get("id"), t.get("token", "")) for t in e.get("top_logprobs") or []]
                    for e in rows]
            return lps, tops if any(tops) else None
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

    def _completion_stream(self, body: dict[str, Any], start: float, client: HttpClient,
                           keep_tops: bool = True) -> Iterator[GenChunk]:
        events = client.stream("/v1/completions", body)
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
                        yield GenChunk(text, ids, lps, tops if keep_tops else None, False, None)
                    if choice.get("finish_reason"):
                        choice_end = choice
                last = ev
        finally:
            events.close()
        if not choice_end:
            raise RequestAborted(f"{self.base_url}/v1/completions: the stream ended without a finish reason")
        merged = {**last, "usage": usage_event.get("usage") or last.get("usage")}
        yield GenChunk("", [], None, None, True, self._completion_meta(merged, choice_end, start, ttft))
