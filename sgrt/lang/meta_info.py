"""What ``s.get_meta_info(name)`` returns, in SGLang's shapes.

A backend reports a generation in sgrt's own terms (``finish_reason`` a string beside
``matched``, token texts always filled in); the interpreter reshapes that here, once, for every
backend, into what SGLang's frontend hands its programs (``sglang.lang.interpreter`` stores the
server's ``meta_info`` as it is):

- ``finish_reason`` is a dict: ``{"type": "stop", "matched": <EOS id, stop string or id, stop
  pattern, or "grammar">}``, ``{"type": "length", "length": <tokens generated>}`` or ``{"type":
  "abort", "message": ...}`` (SGLang's ``FINISH_*.to_json()``, ``srt/managers/schedule_batch.py``;
  for a completed constraint SGLang's ``matched`` is the last token id, a listed departure);
- with ``return_logprob``, ``input_token_logprobs`` is always there: the prompt's entries from
  ``logprob_start_len`` on (the first prompt token's log-probability is ``None``), or ``[]`` when no
  ``logprob_start_len`` was given (SGLang's server then scores no prompt token);
- ``return_text_in_logprobs=False`` sets the text of every log-probability entry to ``None``.

A ``select``'s meta info is built from the scores of its options
(:func:`select_method_inputs`), under the names SGLang's ``RuntimeEndpoint.select`` passes to a
:class:`~sgrt.lang.choices.ChoicesSamplingMethod`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sgrt.backends.base import ChoiceScore
from sgrt.lang.choices import mean_logprob
from sgrt.sampling_params import SamplingParams

#: The meta keys whose values are lists of ``(logprob, token_id, text)`` entries.
ENTRY_KEYS = ("output_token_logprobs", "input_token_logprobs")
#: The meta keys whose values are, per position, lists of such entries.
TOP_KEYS = ("output_top_logprobs", "input_top_logprobs")


def strip_texts(rows: Any) -> Any:
    """``rows`` (a list of ``(logprob, token_id, text)`` entries) with every text ``None``."""
    if rows is None:
        return None
    return [(e[0], e[1], None) if isinstance(e, (tuple, list)) and len(e) == 3 else e for e in rows]


def finish_reason_dict(meta: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` for a backend's meta info (see the module docstring).

    ``length`` is the number of tokens generated: SGLang reports the request's token limit,
    which its server has already clipped to the room left in the context, so the two agree
    whether ``max_tokens`` or the context window ended the generation. An already converted
    dict (or ``None``: not finished) is returned as it is.
    """
    reason = meta.get("finish_reason")
    if reason is None or isinstance(reason, dict):
        return reason
    if reason == "stop":
        return {"type": "stop", "matched": meta.get("matched")}
    if reason == "length":
        return {"type": "length", "length": meta.get("completion_tokens")}
    if reason == "abort":
        return {"type": "abort", "message": meta.get("error")}
    return {"type": str(reason)}


def gen_meta(meta: Any, params: SamplingParams, with_text: bool | None) -> Any:
    """A ``gen``'s meta info as programs read it (see the module docstring); ``meta`` itself
    is not changed.

    Args:
        meta: the backend's meta info (``GenOutput.meta_info``); anything else (``None``) is
            returned as it is.
        params: the call's sampling parameters (``return_logprob``, ``logprob_start_len``).
        with_text: the call's ``return_text_in_logprobs``; ``False`` blanks the entries' texts.
    """
    if not isinstance(meta, dict):
        return meta
    out = dict(meta)
    out["finish_reason"] = finish_reason_dict(meta)
    if params.return_logprob and params.logprob_start_len < 0:
        out.setdefault("input_token_logprobs", [])
    if with_text is False:
        for key in ENTRY_KEYS:
            if out.get(key) is not None:
                out[key] = strip_texts(out[key])
        for key in TOP_KEYS:
            if out.get(key) is not None:
                out[key] = [strip_texts(row) for row in out[key]]
    return out


def select_method_inputs(scores: Sequence[ChoiceScore], unconditional: bool) -> dict[str, Any]:
    """The keyword arguments a choices method gets, besides ``choices`` (SGLang's names):

    - ``input_token_logprobs``: per option, its tokens' ``(logprob, token_id, text)`` entries
      after the prompt (with token healing, the first may re-cover the prompt's last characters);
    - ``output_token_logprobs``: per option ``[]`` (the scoring requests generate nothing);
    - ``normalized_prompt_logprobs``: per option, the mean of its tokens' log-probabilities;
    - ``unconditional_token_logprobs``: with ``unconditional``, per option the same tokens'
      entries scored without the prompt (the first log-probability ``None``); else ``None``.
    """
    def entries(score: ChoiceScore, logprobs: Sequence[float | None]) -> list[tuple]:
        texts = score.token_texts or [None] * len(score.token_ids)
        # NOTE: strict: a backend whose lists disagree is a bug, not something to cut silently.
        return list(zip(logprobs, score.token_ids, texts, strict=True))

    return {
        "normalized_prompt_logprobs": [mean_logprob(sc.token_logprobs) for sc in scores],
        "input_token_logprobs": [entries(sc, sc.token_logprobs) for sc in scores],
        "output_token_logprobs": [[] for _ in scores],
        "unconditional_token_logprobs": (
            [entries(sc, sc.unconditional_logprobs or []) for sc in scores] if unconditional else None),
    }
