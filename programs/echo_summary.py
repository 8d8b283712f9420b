"""``echo_summary``: a one-sentence summary of a text (the session server's test program).

Start it over the session protocol with
``{"type": "session.start", "session": "s1", "program": "echo_summary", "args": {"text": "..."}}``;
the ``message`` that ends the run has the summary in ``outputs["summary"]``.
"""
from __future__ import annotations

import sgrt


@sgrt.function
def echo_summary(s, text: str):
    """Summarize ``text`` in one sentence (``summary``: at most 32 tokens, greedy)."""
    s += sgrt.system("You summarize texts in one short sentence.")
    s += sgrt.user("Summarize this text in one sentence:\n" + text)
    s += sgrt.assistant(sgrt.gen("summary", max_tokens=32))
