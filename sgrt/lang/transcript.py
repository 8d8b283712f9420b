"""A program's text and chat messages, built from constant text and role markers.

Shared by the interpreter (which also appends generated text) and the tracer (which needs the
same text to find a program's constant prefix), so that both apply roles identically.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from sgrt.chat_template import ChatTemplate
from sgrt.errors import InvalidRequest


@dataclass
class Transcript:
    """The prompt text so far (chat template applied) and the OpenAI-style message list.

    ``role_begin_pos`` is where the open message's content starts in ``text``.
    """

    template: ChatTemplate
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    cur_role: str | None = None
    role_begin_pos: int = 0

    def fill(self, value: str) -> None:
        """Append text."""
        self.text += value

    def begin_role(self, role: str) -> None:
        """Open a message of ``role``: append its template prefix.

        If the first message is not a system message and the template has a default system
        prompt, that system message is inserted first (as the model's template would).

        Raises:
            InvalidRequest: (field ``role``) a message is already open (roles do not nest).
        """
        if self.cur_role is not None:
            raise InvalidRequest(
                f"roles do not nest: {role!r} begun inside an open {self.cur_role!r} message",
                field="role")
        if (not self.messages and role != "system"
                and self.template.default_system_prompt is not None):
            self.begin_role("system")
            self.fill(self.template.default_system_prompt)
            self.end_role("system")
        prefix, _ = self.template.prefix_and_suffix(role)
        self.fill(prefix)
        self.cur_role = role
        self.role_begin_pos = len(self.text)

    def end_role(self, role: str) -> None:
        """Close the open message: append the role's suffix and record the message.

        Raises:
            InvalidRequest: (field ``role``) no message of ``role`` is open.
        """
        if self.cur_role != role:
            raise InvalidRequest(
                f"cannot end a {role!r} message: the open message is {self.cur_role!r}",
                field="role")
        content = self.text[self.role_begin_pos:]
        _, suffix = self.template.prefix_and_suffix(role)
        self.fill(suffix)
        self.messages.append({"role": role, "content": content})
        self.cur_role = None

    def copy(self) -> "Transcript":
        """An independent copy (for a fork branch)."""
        return Transcript(self.template, self.text, copy.deepcopy(self.messages), self.cur_role,
                          self.role_begin_pos)
