"""OpenAI requests -> engine prompts and ``SamplingParams``; engine results -> OpenAI objects.

Pure functions over the engine's tokenizer and the wire structs of
:mod:`sgrt.server.openai.protocol`; the HTTP layer (:mod:`sgrt.server.http.server`) does the I/O.
Sampling (the translator to ``SamplingParams``) is in :mod:`sgrt.server.openai.sampling`, chat
prompts and tools in :mod:`sgrt.server.turns.plan`; this module keeps tokens and results, and
re-exports both (``adapter.build_params``, ``adapter.ToolPlan`` ...).

Tool calls reuse the session server's format (:mod:`sgrt.server.turns.tools`): a call is the JSON
object ``{"name": <tool>, "arguments": {...}}``, generated under a Lark grammar with one
``%json`` alternative per tool. ``tool_choice="auto"`` adds a free-text alternative (text that
does not start with ``{``); ``"required"`` and a named tool leave only calls. Tools are described
to the model through the chat template's ``tools=`` when it renders them, else in the system
prompt.
"""
from __future__ import annotations

import uuid
from typing import Any

from sgrt.engine import Result
from sgrt.models.tokenizer import encode_prompt_text, plain_text_bos_id
from sgrt.server.openai import protocol as op

# NOTE: the two halves that moved out stay reachable as adapter.<name>.
from sgrt.server.turns.plan import (  # noqa: F401
    REASONING_OFF, ChatRenderer, ToolPlan, TurnOutput, calls_only_grammar, format_calls, new_call_id,
    plan_tools, read_turn, think_mode,
)
from sgrt.server.openai.sampling import (  # noqa: F401
    CHAT_FIELD_NAMES, COMPLETION_FIELD_NAMES, build_params, chat_params, check_n, check_request_limits,
    completion_params, resolve_max_tokens, response_format_schema, sampling_fields,
)


# ==== tokens ======================================================================================


# NOTE: one BOS rule for the DSL and the servers (sgrt.models.tokenizer); the names here are
# the adapter's.
encode_text = encode_prompt_text
bos_id = plain_text_bos_id


class TokenTexts:
    """Per-id token strings and bytes for logprobs (``token_bytes`` decoded, cached)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            if hasattr(self.tokenizer, "token_bytes"):
                raw = self.tokenizer.token_bytes(token_id)
            else:  # pragma: no cover - a tokenizer without byte access
                raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = hit
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


# ==== results -> responses ========================================================================


def usage_of(prompt_results: list[Result], all_results: list[Result]) -> op.Usage:
    """Usage of a request: prompt and cached tokens once per prompt (from ``prompt_results``,
    its first choice), completion tokens summed over every choice."""
    prompt = sum(r.prompt_tokens for r in prompt_results)
    completion = sum(r.completion_tokens for r in all_results)
    return op.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    prompt_tokens_details=op.PromptTokensDetails(
                        cached_tokens=sum(r.cached_tokens for r in prompt_results)))


def finish_reason_of(result: Result, called: bool = False) -> str:
    """OpenAI's finish reason: ``tool_calls`` for a call, else the engine's ``stop`` /
    ``length``, or ``abort`` for a request aborted without an error (``/abort_request``, server
    shutdown; one that failed is answered as an error by the caller)."""
    if called:
        return "tool_calls"
    return result.finish_reason if result.finish_reason in ("length", "abort") else "stop"


def chat_logprobs(token_ids: list[int], logprobs: list[float] | None,
                  tops: list[list[tuple[int, float]]] | None, texts: TokenTexts) -> op.ChoiceLogprobs:
    """Chat ``logprobs.content`` for generated tokens."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs or [])):
        tok, raw = texts.get(tid)
        top = []
        for t, l in (tops[i] if tops and i < len(tops) else []):
            ttok, traw = texts.get(t)
            top.append(op.TopLogprob(token=ttok, logprob=l, bytes=traw))
        content.append(op.TokenLogprob(token=tok, logprob=lp, bytes=raw, top_logprobs=top))
    return op.ChoiceLogprobs(content=content)


def completion_logprobs(token_ids: list[int], logprobs: list[float | None],
                        tops: list[list[tuple[int, float]]] | None, texts: TokenTexts,
                        offset: int = 0) -> op.CompletionLogprobs:
    """Legacy completion ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset`` from ``offset``, in characters)."""
    out = op.CompletionLogprobs()
    pos = offset
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        tok = texts.text(tid)
        out.tokens.append(tok)
        out.token_logprobs.append(lp)
        row = tops[i] if tops and i < len(tops) else None
        out.top_logprobs.append(None if lp is None and not row else {texts.text(t): l for t, l in (row or [])})
        out.text_offset.append(pos)
        pos += len(tok)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
