"""``chat``: a multi-turn conversation, one assistant reply per user turn.

Each turn is appended to the same program state, so the prompt of turn N is the prompt of turn
N-1 plus its reply plus the new user message: the engine's radix cache serves everything but the
new tokens (``get_meta_info("reply_N")["cached_tokens"]`` grows turn by turn).

Over the session server (``sgrt serve --programs programs/``)::

    {"type": "session.start", "session": "c1", "program": "chat",
     "args": {"turns": ["Hi! Who are you?", "Name three colours."]}}
"""
from __future__ import annotations

from typing import Any, NotRequired, TypedDict

import sgrt

DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly."


class HistoryMessage(TypedDict):
    """One earlier message of ``history`` (a server checks a client's ``history`` against it)."""

    role: str
    content: NotRequired[str]


@sgrt.function
def chat(s, turns: list[str], system: str = DEFAULT_SYSTEM, history: list[HistoryMessage] | None = None,
         max_tokens: int = 48):
    """Answer each of ``turns`` (user messages) in order, as one conversation.

    Inputs:
        turns: the user messages, at least one.
        system: the system prompt.
        history: earlier messages to continue from, OpenAI style
            (``[{"role": "user" | "assistant", "content": ...}, ...]``); not generated.
        max_tokens: the most tokens of each reply.

    Variables:
        ``reply_0`` ... ``reply_{n-1}``: the assistant's reply to each turn (str; meta info has
        ``prompt_tokens``, ``cached_tokens``, ``ttft``...). ``replies``: the list of all of them.
        ``s.messages()`` is the whole conversation.

    Shows: roles and the chat template, multi-turn reuse of the prefix cache.

    Raises:
        ValueError: no turns, or a history message whose role is not user / assistant.
    """
    if not turns:
        raise ValueError("chat needs at least one turn")
    s += sgrt.system(system)
    for msg in history or []:
        role, content = msg.get("role"), msg.get("content", "")
        if role == "user":
            s += sgrt.user(content)
        elif role == "assistant":
            s += sgrt.assistant(content)
        else:
            raise ValueError(f"history roles must be 'user' or 'assistant', got {role!r}")
    for i, turn in enumerate(turns):
        s += sgrt.user(turn)
        s += sgrt.assistant(sgrt.gen(f"reply_{i}", max_tokens=max_tokens))
    s["replies"] = [s[f"reply_{i}"] for i in range(len(turns))]
