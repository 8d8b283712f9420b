"""Tool-call and reasoning formats of model families: detection from the chat template, the
Lark grammar (llguidance syntax) of one assistant turn, and parsing the generated text back
into text, reasoning and calls, all at once or incrementally while it streams.

A format is the text a family's chat template renders for assistant tool calls, which is what
the model was trained to emit:

========  ========================================================  ===========  ===========
name      calls                                                     text first   args key
========  ========================================================  ===========  ===========
generic   ``{"name": ..., "arguments": {...}}`` one per line        no           arguments
hermes    ``<tool_call>\\n{...}\\n</tool_call>`` one per call       yes          arguments
          (Qwen 2.5 / 3, Hermes, and templates that render them)
llama3    ``{"name": ..., "parameters": {...}}``, ``; `` between    no           parameters
mistral   ``[TOOL_CALLS][{...}, {...}]``                            no           arguments
========  ========================================================  ===========  ===========

``generic`` is sgrt's own (for templates that know no tool calls: the tools are described in
the system prompt). The grammar lets the model write free text or, after the family's trigger
(``<tool_call>``, ``[TOOL_CALLS]``, or ``{`` at the start), only well-formed calls of the given
tools (one ``%json`` alternative per tool, its parameters embedded with
:func:`sgrt.server.turns.schema_embed.embed_schema`); with ``parallel`` one or more calls, else one.

Reasoning: a template that writes ``<think>`` marks a thinking model. Its ``<think> ...
</think>`` block is free text (a lazy lexeme, so it ends at the first ``</think>``) ahead of
the constrained answer, and is parsed out as reasoning. ``enable_thinking`` in the template is
the switch that ``reasoning_effort`` maps to.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import GrammarError
from sgrt.server.turns.schema_embed import embed_schema
from sgrt.server.ws.protocol import ToolSpec

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: Most whitespace characters between ``</think>`` and the answer (Qwen 3 writes two newlines):
#: bounded, so that a model cannot spend its tokens on whitespace before a constrained answer.
THINK_GAP_MAX = 4

#: JSON layout of a tool call: compact separators with one space, as the generic system
#: prompt's example shows, so that a small model cannot wander off into whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls (see the module table).

    The calls region is ``list_open + call_open + CALL + call_close + (separator + call_open +
    CALL + call_close)* + list_close``; ``trigger`` (a prefix of ``list_open + call_open``, or
    empty for formats whose calls start with ``{``) is the text that starts it.
    """

    name: str
    trigger: str = ""
    list_open: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = "\n"
    list_close: str = ""
    args_key: str = "arguments"
    text_before: bool = False  # free text may come before the calls
    native: bool = False  # the chat template renders tools= and assistant tool_calls itself

    @property
    def head(self) -> str:
        """The text before the first call's JSON."""
        return self.list_open + self.call_open


GENERIC = ToolFormat("generic")
HERMES = ToolFormat("hermes", trigger="<tool_call>", call_open="<tool_call>\n", call_close="\n</tool_call>",
                    separator="\n", text_before=True, native=True)
LLAMA3 = ToolFormat("llama3", separator="; ", args_key="parameters", native=True)
MISTRAL = ToolFormat("mistral", trigger="[TOOL_CALLS]", list_open="[TOOL_CALLS][", separator=", ",
                     list_close="]", native=True)
FORMATS = {f.name: f for f in (GENERIC, HERMES, LLAMA3, MISTRAL)}


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template says about its family: the tool-call format, whether the model
    thinks (``<think>``) and whether the template has the ``enable_thinking`` switch."""

    tool_format: ToolFormat = GENERIC
    thinking: bool = False
    thinking_switch: str | None = None


def detect_traits(template: str | None) -> TemplateTraits:
    """The traits of a chat template (its Jinja source; None or empty: generic, no thinking).

    Detection reads the literal markers the template renders: ``<tool_call>`` (Hermes / Qwen),
    ``[TOOL_CALLS]`` (Mistral), ``<|python_tag|>`` or a Llama 3 header with ``parameters``
    (Llama 3 JSON tool calling), ``<think>`` (reasoning) and ``enable_thinking``.
    """
    t = template or ""
    if "<tool_call>" in t:
        fmt = HERMES
    elif "[TOOL_CALLS]" in t:
        fmt = MISTRAL
    elif "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t and "parameters" in t):
        fmt = LLAMA3
    else:
        fmt = GENERIC
    thinking = THINK_OPEN in t
    return TemplateTraits(fmt, thinking, "enable_thinking" if thinking and "enable_thinking" in t else None)


# ==== grammar ===================================================================================


def call_schema(tool: ToolSpec, args_key: str = "arguments") -> dict[str, Any]:
    """JSON Schema of one call of ``tool``: ``{"name": <const>, <args_key>: <parameters>}``,
    the parameters' ``$defs`` hoisted to the root and their references rewritten
    (:func:`~sgrt.server.turns.schema_embed.embed_schema`), normalized as every sgrt JSON constraint
    is (objects closed unless the schema says otherwise, free strings capped), with the
    :data:`JSON_LAYOUT` separators.

    Raises:
        GrammarError: (field ``tools``; the message names the tool) the parameters use a
            keyword sgrt cannot enforce, or have no finite instance.
    """
    defs: dict[str, Any] = {}
    params = embed_schema(tool.parameters, f"/properties/{args_key}", defs, "args_")
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }
    if defs:
        schema["$defs"] = defs
    from sgrt.constrained import GrammarOptions, normalize_schema

    from sgrt.constrained.satisfiable import check_satisfiable

    try:
        schema = normalize_schema(schema, GrammarOptions()).schema
        # NOTE: the embedded schema is compiled as part of a Lark grammar (%json), where the
        # compiler's own check of json_schema constraints does not reach: check it here.
        check_satisfiable(schema)
    except GrammarError as e:
        raise GrammarError(f"tool {tool.name!r}: {e}", field="tools", path=e.path) from None
    return {**schema, "x-guidance": JSON_LAYOUT}


def _lit(text: str) -> str:
    return json.dumps(text) if text else ""


def _rx(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    return re.escape(text).replace("/", "\\/")


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def turn_grammar(tools: list[ToolSpec], *, mode: str = "auto", parallel: bool = True,
                 fmt: ToolFormat = GENERIC, think: str | None = None,
                 answer_schema: dict[str, Any] | None = None, trigger_token: int | None = None) -> str | None:
    """The Lark grammar (llguidance syntax) of one assistant turn, or None when nothing
    constrains it.

    Args:
        tools: the tools that may be called (already narrowed to the named one for ``named``).
        mode: ``auto`` (free text or calls), ``required`` / ``named`` (calls only), ``none``
            (no calls: free text, or ``answer_schema``).
        parallel: one or more calls (separated as ``fmt`` says) rather than exactly one.
        fmt: the family's :class:`ToolFormat`.
        think: ``"open"`` (the turn starts with a ``<think>`` block), ``"inside"`` (the
            generation prompt already opened it: the turn starts inside the block) or None.
        answer_schema: a JSON Schema the text answer must match (``response_format``); only
            with ``mode="none"`` or no tools.
        trigger_token: the id of the special token that the trigger is in this vocabulary
            (Mistral's ``[TOOL_CALLS]``): the grammar names the token (``<[id]>``), since a
            special token never matches text. Only for formats without text before the calls.
    """
    rules: list[str] = []
    if mode != "none" and tools:
        names = [f"call_{i}" for i in range(len(tools))]
        rules.append("any_call: " + " | ".join(names))
        rules += [f"{n}: %json {json.dumps(call_schema(t, fmt.args_key))}" for n, t in zip(names, tools)]
        one = _seq(_lit(fmt.call_open), "any_call", _lit(fmt.call_close))
        rest = f"({_seq(_lit(fmt.separator), one)})*" if parallel else ""
        after_head = _seq(_lit(fmt.head[len(fmt.trigger):]), "any_call", _lit(fmt.call_close), rest,
                          _lit(fmt.list_close))
        if fmt.trigger:
            trigger = f"<[{trigger_token}]>" if trigger_token is not None and not fmt.text_before else _lit(fmt.trigger)
            rules.append(f"calls: {trigger} {after_head}")
        else:
            rules.append(f"calls: {after_head}")
        if mode == "auto":
            if fmt.text_before:
                trig = _rx(fmt.trigger)
                rules.append(f"pre[lazy]: /(.|\\n)*{trig}/")
                rules.append(f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{trig}(.|\\n)*/")
                rules.append(f"body: TEXT | pre {after_head}")
            else:
                first = _rx(fmt.trigger or "{")
                rules.append("TEXT: /[^{](.|\\n)*/" if not fmt.trigger else f"TEXT: /(.|\\n)+/ & ~/{first}(.|\\n)*/")
                rules.append("body: TEXT | calls")
        else:
            rules.append("body: calls")
    elif answer_schema is not None:
        rules.append(f"body: %json {json.dumps(answer_schema)}")
    elif think is None:
        return None
    else:
        rules.append("body: /(.|\\n)*/")
    if think in ("open", "inside"):
        close = _rx(THINK_CLOSE)
        opening = _rx(THINK_OPEN) if think == "open" else ""
        rules.insert(0, "start: think WS body")
        rules.append(f"think[lazy]: /{opening}(.|\\n)*{close}/")
        rules.append(f"WS: /[ \\t\\n]{{0,{THINK_GAP_MAX}}}/")
    else:
        rules.insert(0, "start: body")
    return "\n".join(rules) + "\n"


# ==== parsing ===================================================================================


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _scan_string(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``s[i] == '"'``, or None if unfinished."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _scan_value(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``s[i]``, or None if unfinished."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                end = _scan_string(s, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None  # a number or literal may still grow


@dataclass
class CallDraft:
    """A call as parsed so far: ``name`` once its string is complete, ``arguments`` the raw
    JSON text of the arguments so far (a prefix of the final text), ``done`` once the call's
    object is closed."""

    name: str | None = None
    arguments: str = ""
    args_done: bool = False
    done: bool = False


def _scan_call(s: str, i: int, args_keys: tuple[str, ...]) -> tuple[CallDraft, int]:
    """Parse the call object starting at ``s[i] == '{'`` as far as the text goes: the draft and
    the index after it (``len(s)`` while unfinished)."""
    draft = CallDraft()
    j = i + 1
    while True:
        j = _skip_ws(s, j)
        if j >= len(s):
            return draft, len(s)
        if s[j] == "}":
            draft.done = True
            return draft, j + 1
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            return draft, len(s)
        kend = _scan_string(s, j)
        if kend is None:
            return draft, len(s)
        key = json.loads(s[j:kend])
        j = _skip_ws(s, kend)
        if j >= len(s) or s[j] != ":":
            return draft, len(s)
        j = _skip_ws(s, j + 1)
        vend = _scan_value(s, j)
        if key in args_keys:
            draft.arguments = s[j:vend] if vend is not None else s[j:]
            draft.args_done = vend is not None
        elif key == "name" and vend is not None and s[j] == '"':
            draft.name = json.loads(s[j:vend])
        if vend is None:
            return draft, len(s)
        j = vend


@dataclass
class ParsedTurn:
    """A turn's text split up: ``reasoning`` (the think block's text), ``content`` (free text;
    held back while it could still be the start of a call) and the ``calls`` so far."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDraft] = field(default_factory=list)
    in_calls: bool = False


def _trigger_held(text: str, trigger: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``trigger``."""
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-k:]):
            return k
    return 0


def parse_turn(text: str, fmt: ToolFormat = GENERIC, *, may_call: bool = True, think: str | None = None,
               final: bool = False) -> ParsedTurn:
    """Split the text of a turn (so far, or ``final``) into reasoning, content and calls.

    Args:
        fmt: the family's format; ``may_call=False`` reads everything as content.
        think: as in :func:`turn_grammar`: ``"open"`` (a leading ``<think>`` block is
            reasoning), ``"inside"`` (the text starts inside the block) or None.
        final: the whole turn (nothing is held back as a possible trigger prefix).
    """
    out = ParsedTurn()
    rest = text
    if think is not None:
        if think == "open":
            stripped = rest.lstrip()
            if stripped.startswith(THINK_OPEN):
                rest = stripped[len(THINK_OPEN):]
                think = "inside"
            elif not final and THINK_OPEN.startswith(stripped):
                return out  # may still become "<think>"
        if think == "inside":
            end = rest.find(THINK_CLOSE)
            if end < 0:
                held = 0 if final else _trigger_held(rest, THINK_CLOSE)
                out.reasoning = rest[: len(rest) - held]
                return out
            out.reasoning = rest[:end]
            rest = rest[end + len(THINK_CLOSE):].lstrip()
    if not may_call:
        out.content = rest
        return out
    if fmt.trigger:
        start = rest.find(fmt.trigger) if fmt.text_before else (0 if rest.startswith(fmt.trigger) else -1)
        if start < 0:
            if not fmt.text_before and not final and fmt.trigger.startswith(rest):
                return out
            held = 0 if final or not fmt.text_before else _trigger_held(rest, fmt.trigger)
            out.content = rest[: len(rest) - held]
            return out
        out.content = rest[:start] if fmt.text_before else ""
        region = rest[start:]
    else:
        if not rest.startswith("{"):
            out.content = rest
            return out
        region = rest
    out.in_calls = True
    args_keys = (fmt.args_key, "arguments", "parameters")
    i = 0
    if region.startswith(fmt.list_open):
        i = len(fmt.list_open)
    while i < len(region):
        if fmt.call_open:
            if not region.startswith(fmt.call_open, i):
                break
            i += len(fmt.call_open)
        i = _skip_ws(region, i)
        if i >= len(region) or region[i] != "{":
            break
        draft, i = _scan_call(region, i, args_keys)
        out.calls.append(draft)
        if not draft.done:
            break
        if fmt.call_close and region.startswith(fmt.call_close.strip(), _skip_ws(region, i)):
            i = _skip_ws(region, i) + len(fmt.call_close.strip())
        j = _skip_ws(region, i)
        sep = fmt.separator.strip()
        if sep and region.startswith(sep, j):
            i = j + len(sep)
        i = _skip_ws(region, i)
    return out


@dataclass
class ToolCallOut:
    """A finished, well-formed call: ``arguments`` is its JSON text."""

    name: str
    arguments: str


def finished_calls(parsed: ParsedTurn, tools: list[ToolSpec]) -> list[ToolCallOut] | None:
    """The calls of a final parse when every one is complete, names a known tool and has a
    JSON object for arguments; else None (the text is then answered as content)."""
    if not parsed.in_calls or not parsed.calls:
        return None
    known = {t.name for t in tools}
    out = []
    for draft in parsed.calls:
        if not draft.done or draft.name not in known or not draft.args_done:
            return None
        try:
            args = json.loads(draft.arguments)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        out.append(ToolCallOut(draft.name, draft.arguments))
    return out


@dataclass
class StreamEvent:
    """One increment of a streamed turn: ``kind`` is ``reasoning`` / ``text`` (``text``),
    ``call`` (a new call ``index`` with its ``name``) or ``args`` (a fragment ``text`` of call
    ``index``'s arguments)."""

    kind: str
    text: str = ""
    index: int = 0
    name: str = ""


class TurnStreamer:
    """Turns the growing text of a turn into :class:`StreamEvent` increments: reasoning and
    content as they come (content held back only while it could be a trigger's start), a call's
    name as soon as its string is closed, then its arguments in fragments as they are
    generated. Re-parses the whole text per feed (turns are short; the parse is linear)."""

    def __init__(self, fmt: ToolFormat = GENERIC, *, may_call: bool = True, think: str | None = None):
        self.fmt, self.may_call, self.think = fmt, may_call, think
        self.text = ""
        self._reasoning = 0
        self._content = 0
        self._names: list[str] = []
        self._args: list[int] = []
        self.parsed = ParsedTurn()

    def feed(self, delta: str, final: bool = False) -> list[StreamEvent]:
        """Events for the text so far plus ``delta`` (``final``: the turn has ended)."""
        self.text += delta
        p = parse_turn(self.text, self.fmt, may_call=self.may_call, think=self.think, final=final)
        self.parsed = p
        events: list[StreamEvent] = []
        if len(p.reasoning) > self._reasoning:
            events.append(StreamEvent("reasoning", p.reasoning[self._reasoning:]))
            self._reasoning = len(p.reasoning)
        if len(p.content) > self._content:
            events.append(StreamEvent("text", p.content[self._content:]))
            self._content = len(p.content)
        for k, draft in enumerate(p.calls):
            if draft.name is None:
                break
            if k >= len(self._names):
                self._names.append(draft.name)
                self._args.append(0)
                events.append(StreamEvent("call", index=k, name=draft.name))
            if len(draft.arguments) > self._args[k]:
                events.append(StreamEvent("args", draft.arguments[self._args[k]:], index=k))
                self._args[k] = len(draft.arguments)
        return events

    @property
    def calls_started(self) -> int:
        return len(self._names)
