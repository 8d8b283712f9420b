"""Role prefixes and suffixes: how ``s.user(...)`` becomes the model's chat format.

Rather than keeping a table of templates per model family (as SGLang does), we learn each
role's prefix and suffix from the model's own chat template: render a short conversation whose
contents are sentinel strings and cut the text around them. Any HF template whose messages are
``prefix + content + suffix`` works; the result is checked by re-rendering.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest

Renderer = Callable[[list[dict[str, str]], bool], str]

_S, _U, _A, _U2 = "SGRTSENTINELSYS0", "SGRTSENTINELUSR1", "SGRTSENTINELAST2", "SGRTSENTINELUSR3"


@dataclass(frozen=True)
class ChatTemplate:
    """Per-role text around message contents.

    ``role_prefix_and_suffix[role] = (prefix, suffix)``. ``default_system_prompt`` is inserted
    as a system message when a program's first message is not one (as the model's template
    does when rendering such a conversation). ``stop_str`` lists the strings that end an
    assistant turn; it is informational: the DSL never adds them to a ``gen``'s stops (the
    engine stops at the end-of-turn token anyway).
    """

    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]] = field(default_factory=dict)
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()

    def prefix_and_suffix(self, role: str) -> tuple[str, str]:
        """The ``(prefix, suffix)`` of ``role``.

        Raises:
            InvalidRequest: (field ``role``) the template has no such role.
        """
        try:
            return self.role_prefix_and_suffix[role]
        except KeyError:
            raise InvalidRequest(f"chat template {self.name!r} has no role {role!r}",
                                 field="role") from None


#: ChatML (SmolLM2, Qwen, ...), without a default system prompt.
CHATML = ChatTemplate(
    name="chatml",
    role_prefix_and_suffix={
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    },
    stop_str=("<|im_end|>",),
)

#: Plain text roles, for models without a chat template and for tracing without a backend.
PLAIN = ChatTemplate(
    name="plain",
    role_prefix_and_suffix={
        "system": ("SYSTEM: ", "\n"),
        "user": ("USER: ", "\n"),
        "assistant": ("ASSISTANT: ", "\n"),
    },
)


#: SGLang's ``"default"`` template (``sglang.lang.chat_template``): bare role labels.
SGLANG_DEFAULT = ChatTemplate(
    name="default",
    role_prefix_and_suffix={
        "system": ("SYSTEM:", "\n"),
        "user": ("USER:", "\n"),
        "assistant": ("ASSISTANT:", "\n"),
    },
)

#: Templates by SGLang's registry names, for ``RuntimeEndpoint(chat_template_name=...)``.
NAMED_TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": CHATML,
    "qwen": ChatTemplate(name="qwen", role_prefix_and_suffix=dict(CHATML.role_prefix_and_suffix),
                         default_system_prompt="You are a helpful assistant.",
                         stop_str=("<|im_end|>",)),
    "llama-3-instruct": ChatTemplate(
        name="llama-3-instruct",
        role_prefix_and_suffix={
            role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")
            for role in ("system", "user", "assistant")},
        stop_str=("<|eot_id|>",)),
    "default": SGLANG_DEFAULT,
    "plain": PLAIN,
}


def get_chat_template(name: str) -> ChatTemplate:
    """The template SGLang registers under ``name`` (those sgrt knows: :data:`NAMED_TEMPLATES`).

    Raises:
        InvalidRequest: (field ``chat_template_name``) a name sgrt does not know.
    """
    try:
        return NAMED_TEMPLATES[name]
    except (KeyError, TypeError):
        raise InvalidRequest(f"unknown chat template {name!r}; known: {', '.join(sorted(NAMED_TEMPLATES))} "
                             "(or pass chat_template=ChatTemplate(...))",
                             field="chat_template_name") from None


def _cut(text: str, start: str, end: str | None) -> str:
    """The text strictly between sentinel ``start`` and ``end`` (or the end of ``text``)."""
    i = text.index(start) + len(start)
    return text[i:] if end is None else text[i:text.index(end, i)]


def _strip_bos(text: str, bos: str | None) -> str:
    return text[len(bos):] if bos and text.startswith(bos) else text


def derive_chat_template(render: Renderer, name: str = "derived",
                         bos_token: str | None = None) -> ChatTemplate:
    """Learn role prefixes/suffixes from ``render(messages, add_generation_prompt) -> str``.

    A leading ``bos_token`` is left out of the prefixes (the backend adds BOS where the
    tokenizer does). Templates that refuse a system message get the system role rendered as the
    user role's prefix and suffix.

    Raises:
        InvalidRequest: (field ``chat_template``) the template does not render messages as
            ``prefix + content + suffix`` (pass an explicit :class:`ChatTemplate` instead).
    """
    sys_msg = {"role": "system", "content": _S}
    usr = {"role": "user", "content": _U}
    ast = {"role": "assistant", "content": _A}
    usr2 = {"role": "user", "content": _U2}
    try:
        has_system = _S in render([sys_msg, usr], False)
    except Exception:  # noqa: BLE001 - templates raise anything (jinja's raise_exception)
        has_system = False
    try:
        if has_system:
            convo = render([sys_msg, usr, ast, usr2], False)
            sys_suffix = _cut(render([sys_msg], False), _S, None)
            between = _cut(convo, _S, _U)
            if not between.startswith(sys_suffix):
                raise ValueError("system suffix is not followed by the user prefix")
            user_prefix = between[len(sys_suffix):]
            sys_prefix = _strip_bos(convo[:convo.index(_S)], bos_token)
        else:
            convo = render([usr, ast, usr2], False)
        first_user_head = _strip_bos(render([usr], False).split(_U)[0], bos_token)
        if not has_system:
            user_prefix = first_user_head
        user_suffix = _cut(render([usr], False), _U, None)
        between = _cut(convo, _U, _A)
        if not between.startswith(user_suffix):
            raise ValueError("user suffix is not followed by the assistant prefix")
        assistant_prefix = between[len(user_suffix):]
        after_a = _cut(convo, _A, _U2)
        if not after_a.endswith(user_prefix):
            raise ValueError("assistant suffix is not followed by the user prefix")
        assistant_suffix = after_a[: len(after_a) - len(user_prefix)]
        pieces = [user_prefix, user_suffix, assistant_prefix, assistant_suffix]
        expected = (user_prefix + _U + user_suffix + assistant_prefix + _A + assistant_suffix
                    + user_prefix + _U2 + user_suffix)
        if has_system:
            pieces += [sys_prefix, sys_suffix]
            expected = sys_prefix + _S + sys_suffix + expected
        if any(x in p for p in pieces for x in (_S, _U, _A, _U2)):
            raise ValueError("a message's content appears outside its place")
        if not _strip_bos(convo, bos_token).endswith(expected):
            raise ValueError("re-rendering a conversation from the derived parts differs")
        base = render([usr], False)
        gen_prompt = render([usr], True)
        if gen_prompt.startswith(base) and gen_prompt != base:
            # NOTE: what the model sees when it is to answer; some templates render past
            # assistant turns differently (e.g. reasoning tags), the live turn is what counts.
            assistant_prefix = gen_prompt[len(base):]
        default_system = None
        if has_system and first_user_head != user_prefix:
            head = first_user_head[: len(first_user_head) - len(user_prefix)]
            if (first_user_head.endswith(user_prefix) and head.startswith(sys_prefix)
                    and head.endswith(sys_suffix)):
                default_system = head[len(sys_prefix): len(head) - len(sys_suffix)]
            else:
                raise ValueError("cannot isolate the default system prompt")
    except InvalidRequest:
        raise  # the apply function's own typed error (no chat template at all: field "messages")
    except ValueError as e:
        raise InvalidRequest(
            f"cannot derive role prefixes from the chat template ({e}); "
            "pass an explicit sgrt.lang.ChatTemplate", field="chat_template") from None
    if not has_system:
        sys_prefix, sys_suffix = user_prefix, user_suffix
    stop = assistant_suffix.strip()
    return ChatTemplate(
        name=name,
        role_prefix_and_suffix={
            "system": (sys_prefix, sys_suffix),
            "user": (user_prefix, user_suffix),
            "assistant": (assistant_prefix, assistant_suffix),
        },
        default_system_prompt=default_system,
        stop_str=(stop,) if stop else (),
    )


_cache: "weakref.WeakKeyDictionary[Any, ChatTemplate]" = weakref.WeakKeyDictionary()


def chat_template_for(backend: Any) -> ChatTemplate:
    """The chat template to use with ``backend`` (derived once per backend, then cached).

    An explicit ``backend.chat_template`` wins; a backend whose model has no chat template gets
    :data:`PLAIN`.
    """
    if backend is None:
        return PLAIN
    explicit = getattr(backend, "chat_template", None)
    if isinstance(explicit, ChatTemplate):
        return explicit
    cached = _cache.get(backend)
    if cached is not None:
        return cached
    try:
        bos = backend.bos_token()
        template = derive_chat_template(
            lambda msgs, gen: backend.apply_chat_template(msgs, add_generation_prompt=gen),
            name=type(backend).__name__, bos_token=bos)
    except InvalidRequest as e:
        if e.field == "chat_template":
            raise
        template = PLAIN  # the model has no chat template
    _cache[backend] = template
    return template
