"""Wire structs of sgrt's native endpoints, shaped like SGLang's (msgspec): ``POST /generate``,
``/tokenize``, ``/detokenize``, ``/apply_chat_template``, ``/abort_request``. Decoded strictly
(``forbid_unknown_fields``), as the OpenAI structs of :mod:`sgrt.server.openai.protocol` are.
"""
from __future__ import annotations

from typing import Any

import msgspec

from sgrt.server.openai.protocol import ChatMessage


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /generate`` (native): ``text`` or ``input_ids``, one prompt or a list (a batch).

    ``sampling_params`` holds :class:`sgrt.engine.SamplingParams` fields (``max_new_tokens`` is
    accepted for ``max_tokens``); one dict for the whole batch or one per prompt. The top-level
    ``return_logprob``, ``logprob_start_len`` (an int, or one per prompt) and
    ``top_logprobs_num`` override the same fields of ``sampling_params``.

    The rest are SGLang's ``GenerateReqInput`` fields (an SGLang router sends them all), checked
    by :mod:`sgrt.server.sglang.fields`: honoured, ignored with a warning, or refused by name.
    """

    text: str | list[str] | None = None
    input_ids: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # SGLang's GenerateReqInput (see sgrt.server.sglang.fields).
    model: str | None = None
    log_metrics: Any = True
    no_logs: Any = False
    priority: Any = None
    extra_key: Any = None
    custom_labels: Any = None
    conversation_id: Any = None
    data_parallel_rank: Any = None
    routed_dp_rank: Any = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = False
    return_bytes: Any = False
    return_entropy: Any = False
    background: Any = False
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /tokenize``: ``prompt`` (a string or a list of strings) or chat ``messages``.

    ``add_special_tokens`` (default true) encodes text as ``/v1/completions`` and ``/generate``
    do: with the BOS the model's tokenizer adds (none for SmolLM2).
    """

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /detokenize``: ``tokens`` back to text (special tokens kept)."""

    model: str | None = None
    tokens: list[int]


class ChatTemplateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /apply_chat_template``: render ``messages`` with the model's chat template."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /abort_request``: abort the request ``rid`` (unknown or finished ids are ignored)."""

    rid: str
