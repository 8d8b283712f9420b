"""SGLang's request fields on sgrt's native ``/generate`` and on ``/v1/completions``.

An SGLang router (``sglang-router``, the ``smg`` gateway) in front of sgrt workers parses each
``/generate`` body into SGLang's ``GenerateReqInput`` and sends it on with every field spelled
out (``model``, ``log_metrics``, ``return_hidden_states``, ``background``, ``no_logs``,
``return_bytes``, ``return_entropy``...), and adds ``no_stop_trim``, ``return_hidden_states``
and the like to ``/v1/completions``. SGLang's own server takes them, so sgrt does too, one of
three ways per field:

- honoured: ``sampling_params.no_stop_trim`` (the stop string stays at the end of the text),
  ``min_new_tokens`` (= ``min_tokens``), ``sampling_seed`` (= ``seed``), ``n`` = 1;
- accepted and ignored where it cannot change the answer (logging, metrics labels, scheduling
  priority, cache namespaces, stream chunking, the ``model`` name of a one-model server): a
  warning in the log, once per field, when a request sets it to something other than SGLang's
  default;
- refused with :class:`InvalidRequest` naming the field where it asks for something sgrt does not
  do (images, LoRA adapters, hidden states, EBNF grammars, ``n`` > 1 on ``/generate``...) and
  is set to anything but its default: an answer without it would be silently different.

A field SGLang does not have either stays a 400 (``forbid_unknown_fields`` on the request
structs, ``SamplingParams.from_dict`` for ``sampling_params``).

Source: SGLang's ``GenerateReqInput`` (``sglang/srt/managers/io_struct.py``), its
``SamplingParams`` and OpenAI-compatible ``CompletionRequest``; the bodies were checked against
what ``sglang-router`` 0.3.2 actually forwards (README, "Serving and connecting").
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from sgrt.errors import InvalidRequest

_log = logging.getLogger("sgrt.server.http")
_warned: set[str] = set()
_warned_lock = threading.Lock()

#: Top-level ``/generate`` fields that change nothing sgrt returns -> SGLang's default (a
#: request that sets another value gets a one-time warning in the log).
IGNORED_GENERATE_FIELDS: dict[str, Any] = {
    "model": None, "log_metrics": True, "no_logs": False, "priority": None, "extra_key": None,
    "custom_labels": None, "conversation_id": None, "data_parallel_rank": None, "routed_dp_rank": None,
}
#: Top-level ``/generate`` fields sgrt cannot honour -> the default that asks for nothing, and why.
REFUSED_GENERATE_FIELDS: dict[str, tuple[Any, str]] = {
    "input_embeds": (None, "sgrt takes text or input_ids"),
    "image_data": (None, "sgrt serves text-only models"),
    "video_data": (None, "sgrt serves text-only models"),
    "audio_data": (None, "sgrt serves text-only models"),
    "modalities": (None, "sgrt serves text-only models"),
    "token_ids_logprob": (None, "use top_logprobs_num or logprob_start_len"),
    "return_hidden_states": (False, "sgrt does not return hidden states"),
    "return_bytes": (False, "sgrt returns text"),
    "return_entropy": (False, "sgrt does not return entropies"),
    "background": (False, "sgrt answers in the request"),
    "session_params": (None, "sgrt has no SGLang sessions (use the WebSocket sessions)"),
    "lora_path": (None, "sgrt has no LoRA adapters"),
    "lora_id": (None, "sgrt has no LoRA adapters"),
    "custom_logit_processor": (None, "sgrt runs no custom logit processors"),
    "bootstrap_host": (None, "sgrt has no prefill/decode disaggregation"),
    "bootstrap_port": (None, "sgrt has no prefill/decode disaggregation"),
    "bootstrap_room": (None, "sgrt has no prefill/decode disaggregation"),
    "bootstrap_pair_key": (None, "sgrt has no prefill/decode disaggregation"),
}
#: ``sampling_params`` keys spelled SGLang's way -> sgrt's name.
SAMPLING_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
#: ``sampling_params`` keys that change nothing sgrt returns -> SGLang's default.
IGNORED_SAMPLING_FIELDS: dict[str, Any] = {"spaces_between_special_tokens": True, "stream_interval": None,
                                           "custom_params": None}
#: ``sampling_params`` keys sgrt cannot honour -> the default that asks for nothing, and why.
REFUSED_SAMPLING_FIELDS: dict[str, tuple[Any, str]] = {
    "ebnf": (None, "sgrt takes Lark grammars in 'grammar', not EBNF"),
    "structural_tag": (None, "sgrt has no structural tags; use json_schema, regex or grammar"),
    "stop_regex": (None, "sgrt stops on strings ('stop') and token ids ('stop_token_ids')"),
    "logit_bias": (None, "logit_bias is not supported"),
}


def warn_ignored(field: str, value: Any) -> None:
    """Log once per process that ``field`` was set to ``value`` and has no effect here."""
    with _warned_lock:
        if field in _warned:
            return
        _warned.add(field)
    _log.warning("SGLang field %s=%r accepted and ignored: it does not change what sgrt returns", field,
                 value)


def _is_default(value: Any, default: Any) -> bool:
    return value is None if default is None else value == default or value is None


def check_generate_fields(values: dict[str, Any]) -> None:
    """Check the SGLang-only top-level fields of one ``/generate`` request.

    Args:
        values: field name -> value (every name of :data:`IGNORED_GENERATE_FIELDS` and
            :data:`REFUSED_GENERATE_FIELDS` that the request struct holds).

    Raises:
        InvalidRequest: a refused field set to something other than its default (``field`` is
            its name).
    """
    for name, (default, why) in REFUSED_GENERATE_FIELDS.items():
        value = values.get(name)
        if not _is_default(value, default) and not (isinstance(value, list) and not any(value)):
            raise InvalidRequest(f"{name} is not supported: {why}", field=name)
    for name, default in IGNORED_GENERATE_FIELDS.items():
        value = values.get(name)
        if name == "model" or _is_default(value, default):
            continue
        if name in ("data_parallel_rank", "routed_dp_rank") and value != 0:
            raise InvalidRequest(f"{name} must be 0 or null: this server is one data-parallel rank", field=name)
        warn_ignored(name, value)


def sampling_fields(sp: dict[str, Any], prefix: str = "sampling_params") -> dict[str, Any]:
    """``sampling_params`` with SGLang's spellings turned into sgrt's and its ignored keys dropped.

    ``max_new_tokens`` -> ``max_tokens``, ``min_new_tokens`` -> ``min_tokens``,
    ``sampling_seed`` -> ``seed``; ``n`` must be 1; ``no_stop_trim`` is kept (sgrt honours it).

    Raises:
        InvalidRequest: both spellings of one field, ``n`` other than 1, or a refused key set
            (``field`` is ``prefix.<key>``).
    """
    fields = dict(sp)
    for sglang_name, name in SAMPLING_ALIASES.items():
        if sglang_name in fields:
            if name in fields:
                raise InvalidRequest(f"give {name} or {sglang_name}, not both", field=f"{prefix}.{name}")
            fields[name] = fields.pop(sglang_name)
    n = fields.pop("n", None)
    if n is not None and n != 1:
        raise InvalidRequest(f"n must be 1 on /generate (send the prompt n times, or use /v1/completions), "
                             f"got {n!r}", field=f"{prefix}.n")
    for name, (default, why) in REFUSED_SAMPLING_FIELDS.items():
        value = fields.pop(name, None)
        if not _is_default(value, default) and value != {}:
            raise InvalidRequest(f"{name} is not supported: {why}", field=f"{prefix}.{name}")
    for name, default in IGNORED_SAMPLING_FIELDS.items():
        value = fields.pop(name, default)
        if not _is_default(value, default):
            warn_ignored(f"{prefix}.{name}", value)
    return fields


def completion_fields(no_stop_trim: bool | None, ebnf: str | None, return_hidden_states: bool | None) -> dict[str, Any]:
    """SGLang's extras of ``/v1/completions`` and ``/v1/chat/completions`` as SamplingParams
    fields: ``no_stop_trim`` honoured; ``ebnf`` and ``return_hidden_states: true`` refused.

    Raises:
        InvalidRequest: ``ebnf`` set, or ``return_hidden_states`` true (``field`` names it).
    """
    if ebnf is not None:
        raise InvalidRequest(f"ebnf is not supported: {REFUSED_SAMPLING_FIELDS['ebnf'][1]}", field="ebnf")
    if return_hidden_states:
        raise InvalidRequest("return_hidden_states is not supported: sgrt does not return hidden states",
                             field="return_hidden_states")
    return {} if no_stop_trim is None else {"no_stop_trim": no_stop_trim}


def request_ids(rid: str | list[str] | None, n_calls: int) -> list[str | None] | None:
    """SGLang's ``rid`` of an OpenAI-style request as one id per engine call (for
    ``/abort_request``): a string for a single call, or a list with one id per call.

    Raises:
        InvalidRequest: (field ``rid``) a string for several calls, or a list of the wrong length.
    """
    if rid is None:
        return None
    if isinstance(rid, str):
        if n_calls != 1:
            raise InvalidRequest(f"rid: give a list of {n_calls} ids for {n_calls} choices", field="rid")
        return [rid]
    if len(rid) != n_calls:
        raise InvalidRequest(f"rid has {len(rid)} ids for {n_calls} choices", field="rid")
    return list(rid)


#: SGLang's chat-completion extras that only shape where reasoning text goes -> SGLang's default.
IGNORED_CHAT_FIELDS: dict[str, Any] = {"separate_reasoning": True, "stream_reasoning": True,
                                       "include_reasoning": True}


def check_chat_fields(values: dict[str, Any]) -> None:
    """SGLang's chat extras: ``continue_final_message: true`` refused (sgrt always opens a new
    assistant turn); the reasoning switches (:data:`IGNORED_CHAT_FIELDS`) ignored with a warning
    when set to something other than SGLang's default.

    Raises:
        InvalidRequest: ``continue_final_message`` true (``field`` names it).
    """
    if values.get("continue_final_message"):
        raise InvalidRequest("continue_final_message is not supported: sgrt opens a new assistant turn",
                             field="continue_final_message")
    for name, default in IGNORED_CHAT_FIELDS.items():
        if not _is_default(values.get(name), default):
            warn_ignored(name, values.get(name))
