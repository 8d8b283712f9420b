"""Splitting a thinking model's reasoning from its answer (``sgrt.separate_reasoning``).

Follows SGLang's ``ReasoningParser(model_type).parse_non_stream`` (its detector's
``detect_and_parse``) for the ``<think>`` family: a generation is *in reasoning* when the model
type always starts in reasoning (DeepSeek-R1 writes its thoughts without an opening tag) or when
the text contains the start tag. Then every start tag is removed and the text is stripped of
surrounding whitespace; the text up to the first end tag is the reasoning (its trailing
whitespace kept) and the rest, stripped, the answer: ``"<think> abc </think>  Four"`` gives
``("abc ", "Four")``. With no end tag (cut by ``max_tokens``) everything is reasoning and the
answer is empty. Text not in reasoning is all answer, unchanged. (SGLang's parser has kept the
whitespace since its PR 24251, May 2026; this is the stripping form it had until then.)
"""
from __future__ import annotations

from dataclasses import dataclass

from sgrt.errors import InvalidRequest


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags of one model family. ``force_reasoning``: the output starts inside reasoning."""

    start: str
    end: str
    force_reasoning: bool = False


_THINK = ReasoningFormat("<think>", "</think>")
_THINK_FORCED = ReasoningFormat("<think>", "</think>", force_reasoning=True)

#: SGLang's ``--reasoning-parser`` names that use these tags. ``None`` (no model type given)
#: means the plain ``<think>...</think>`` format.
REASONING_FORMATS: dict[str | None, ReasoningFormat] = {
    None: _THINK,
    "deepseek-r1": _THINK_FORCED,
    "deepseek-v3": _THINK,
    "qwen3": _THINK,
    "qwen3-thinking": _THINK_FORCED,
    "glm45": _THINK,
    "kimi": ReasoningFormat("\u25c1think\u25b7", "\u25c1/think\u25b7"),
    "kimi_k2": _THINK,
    "step3": _THINK_FORCED,
    "minimax": _THINK_FORCED,
    "nano_v3": _THINK,
    "interns1": _THINK,
}


def reasoning_format(model_type: str | None) -> ReasoningFormat:
    """The tags for ``model_type``.

    Raises:
        InvalidRequest: (field ``model_type``) a model type without a known format.
    """
    try:
        return REASONING_FORMATS[model_type]
    except (KeyError, TypeError):
        known = ", ".join(sorted(k for k in REASONING_FORMATS if k))
        raise InvalidRequest(f"separate_reasoning: unknown model_type {model_type!r}; known: {known}",
                             field="model_type") from None


def split_reasoning(text: str, model_type: str | None = None) -> tuple[str, str]:
    """``(reasoning, answer)`` of a finished generation (see the module docstring).

    Raises:
        InvalidRequest: an unknown ``model_type``.
    """
    fmt = reasoning_format(model_type)
    if not fmt.force_reasoning and fmt.start not in text:
        return "", text
    body = text.replace(fmt.start, "").strip()
    if fmt.end not in body:
        return body, ""
    reasoning, answer = body.split(fmt.end, 1)
    return reasoning, answer.strip()
