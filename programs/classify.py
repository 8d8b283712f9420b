"""``classify``: few-shot classification with ``select`` over a fixed set of labels.

The model does not generate the label: ``select`` prefills the prompt once, scores every label
by the log-probabilities of its own tokens in one batch of prefill-only requests, and picks the
best (``token_length_normalized`` by default). So the answer is always one of the labels, and
``get_meta_info("label")["normalized_prompt_logprobs"]`` says how sure the model was.

Over the session server::

    {"type": "session.start", "session": "k1", "program": "classify",
     "args": {"text": "The parcel arrived broken and nobody answers the phone."}}
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import sgrt


class Example(TypedDict):
    """A labelled example given as an object (a server checks a client's ``examples`` against
    ``(text, label)`` pairs or this)."""

    text: str
    label: str


DEFAULT_LABELS = ["positive", "negative", "neutral"]
DEFAULT_EXAMPLES: list[tuple[str, str]] = [
    ("I love this phone, the battery lasts for days.", "positive"),
    ("The food was cold and the waiter was rude.", "negative"),
    ("The meeting is scheduled for Tuesday at noon.", "neutral"),
    ("What a wonderful surprise, thank you so much!", "positive"),
    ("My order never arrived and I want a refund.", "negative"),
]
DEFAULT_INSTRUCTION = "Classify the sentiment of each text as positive, negative or neutral."


@sgrt.function
def classify(s, text: str, labels: Sequence[str] = tuple(DEFAULT_LABELS),
             examples: Sequence[tuple[str, str] | Example] = tuple(DEFAULT_EXAMPLES),
             instruction: str = DEFAULT_INSTRUCTION):
    """Label ``text`` with one of ``labels``, after a few labelled examples.

    Inputs:
        text: the text to classify (one line reads best).
        labels: the possible labels (non-empty strings).
        examples: ``(text, label)`` pairs (lists or ``{"text", "label"}`` dicts over JSON)
            shown before ``text``.
        instruction: the first line of the prompt.

    Variables:
        ``label``: the chosen label (always one of ``labels``); its meta info holds the
        per-label ``normalized_prompt_logprobs`` and the tokens scored for each.

    Shows: ``select`` scored from log-probabilities, a constant few-shot prefix that
    ``run_batch`` puts into the prefix cache once for the whole batch.
    """
    s += instruction + "\n\n"
    for example in examples:
        ex_text, ex_label = (example["text"], example["label"]) if isinstance(example, dict) else example
        s += "Text: " + ex_text + "\nLabel: " + ex_label + "\n\n"
    s += "Text: " + text + "\nLabel: " + sgrt.select("label", list(labels))
