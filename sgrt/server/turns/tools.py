"""Tools of a session: checking their specs, describing them to the model, one grammar for a turn,
and reading a tool call back out of the generated text.

Each assistant turn of a session with tools is generated under one Lark grammar (llguidance
syntax, passed as ``SamplingParams.grammar``)::

    start: TEXT | call_0 | call_1 ...
    TEXT: /[^{](.|\\n)*/
    call_0: %json {"type": "object", "properties": {"name": {"const": "calculator"},
                   "arguments": <the tool's parameters schema>}, ...}

(the parameters' ``$defs`` hoisted to the call schema's root, so that nested models work:
:mod:`sgrt.server.turns.schema_embed`), so the model chooses between free text (which cannot start with ``{``) and exactly one
``{"name": ..., "arguments": ...}`` object whose arguments match that tool's schema. The grammar
guarantees the shape; the system prompt (:func:`tools_system_prompt`) tells the model when to use
which. ``tool_choice`` narrows it, as in OpenAI's API: ``"required"`` (a call of some tool),
a tool's name (a call of that tool) or ``"none"`` (text only, not starting with ``{``). Tools run on the client: the
server only reports the call.
"""
from __future__ import annotations

import json
import re
from typing import Any

from sgrt.errors import GrammarError, InvalidRequest
from sgrt.server.ws.protocol import LimitExceeded, ToolSpec

TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")
TOOL_CHOICES = ("auto", "required", "none")

def check_tools(tools: list[ToolSpec], max_tools: int) -> None:
    """Validate tool specs.

    Raises:
        InvalidRequest: field ``tools[i].name`` (bad or duplicate name) or ``tools[i].parameters``
            (not an object schema).
        LimitExceeded: ``limit.tools``, field ``tools`` (more than ``max_tools``).
    """
    if len(tools) > max_tools:
        raise LimitExceeded("limit.tools", f"{len(tools)} tools exceed max_tools ({max_tools})", field="tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not TOOL_NAME.match(tool.name):
            raise InvalidRequest(
                f"tool name {tool.name!r} must match {TOOL_NAME.pattern}", field=f"tools[{i}].name")
        if tool.name in seen:
            raise InvalidRequest(f"duplicate tool name {tool.name!r}", field=f"tools[{i}].name")
        seen.add(tool.name)
        kind = tool.parameters.get("type", "object")
        if kind != "object":
            raise InvalidRequest(
                f"tool parameters must be an object schema, got type {kind!r}", field=f"tools[{i}].parameters")


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """JSON Schema of one call of ``tool``: ``{"name": <const>, "arguments": <parameters>}``
    (:func:`sgrt.server.turns.formats.call_schema`: the parameters' ``$defs`` hoisted and their
    references rewritten, normalized, one space after ``:`` and ``,``).

    Raises:
        GrammarError: the parameters use a keyword sgrt cannot enforce (names it).
    """
    from sgrt.server.turns.formats import call_schema as format_call_schema

    return format_call_schema(tool)


def check_tool_choice(choice: str, tools: list[ToolSpec], field: str = "tool_choice") -> None:
    """``choice`` is ``"auto"``, ``"required"``, ``"none"`` or the name of one of ``tools``.

    Raises:
        InvalidRequest: naming ``field``.
    """
    if choice in TOOL_CHOICES or any(t.name == choice for t in tools):
        return
    raise InvalidRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a tool name, got {choice!r}",
                         field=field)


def tool_grammar(tools: list[ToolSpec], choice: str = "auto") -> str | None:
    """The Lark grammar (llguidance syntax) of one assistant turn.

    ``choice="auto"``: free text not starting with ``{``, or one call of one of ``tools`` (one
    alternative per tool); ``"required"``: one call of any tool; a tool's name: one call of that
    tool; ``"none"``: free text not starting with ``{`` only (so that a small model cannot imitate
    a call it saw earlier in the conversation). None when there are no tools.
    """
    if not tools:
        return None
    if choice == "none":
        return "start: TEXT\nTEXT: /[^{](.|\\n)*/\n"
    chosen = [t for t in tools if t.name == choice] or tools
    names = [f"call_{i}" for i in range(len(chosen))]
    lines = ["start: " + ("TEXT | " if choice == "auto" else "") + " | ".join(names)]
    if choice == "auto":
        lines.append("TEXT: /[^{](.|\\n)*/")
    for name, tool in zip(names, chosen):
        lines.append(f"{name}: %json {json.dumps(call_schema(tool))}")
    return "\n".join(lines) + "\n"


def validate_tool_grammar(tools: list[ToolSpec]) -> None:
    """Compile-check each tool's schema now, so that a bad schema is refused at
    ``session.start`` (naming the tool) rather than at the first turn. Skipped when llguidance
    is not installed (the engine's compiler then reports it at the first turn).

    Raises:
        GrammarError: field ``tools[i].parameters``.
    """
    try:
        import llguidance
    except ImportError:  # pragma: no cover - llguidance is a dependency
        return
    from sgrt.constrained.limits import GrammarLimits, check_schema

    limits = GrammarLimits()
    for i, tool in enumerate(tools):
        try:
            # NOTE: before llguidance sees it: a deep $ref chain overflows its compiler's stack
            # (sgrt/constrained/limits.py); the engine's compiler checks the turn grammar again.
            check_schema(tool.parameters, limits)
        except GrammarError as e:
            raise GrammarError(f"tool {tool.name!r}: {e}", field=f"tools[{i}].parameters", path=e.path) from None
        try:
            grammar = llguidance.grammar_from("lark", tool_grammar([tool]))
        except GrammarError as e:  # call_schema's message names the tool already
            raise GrammarError(str(e), field=f"tools[{i}].parameters", path=e.path) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            detail = "; ".join(str(m) for m in messages)[:500]
            raise GrammarError(f"tool {tool.name!r}: its parameters schema does not compile: {detail}",
                               field=f"tools[{i}].parameters")


def tools_system_prompt(tools: list[ToolSpec], fmt: Any = None, parallel: bool = False) -> str:
    """Plain-text description of ``tools`` for the system prompt (used when the model's chat
    template does not render ``tools=`` itself), with an example call in ``fmt``
    (a :class:`sgrt.server.turns.formats.ToolFormat`; default: the generic one-JSON-object
    format) and, with ``parallel``, how to make several calls in one reply."""
    from sgrt.server.turns.formats import GENERIC

    fmt = fmt or GENERIC
    key = fmt.args_key
    call = f'{{"name": <tool name>, "{key}": {{...}}}}'
    if fmt.name == "generic":
        how = f"reply with only a JSON object of the form {call} and nothing else"
    else:
        how = f"write {fmt.head}{call}{fmt.call_close}{fmt.list_close}"
    lines = [f"You can call tools. To call one, {how}. Otherwise reply with plain text."]
    if parallel:
        sep = {"\n": "a new line"}.get(fmt.separator, repr(fmt.separator))
        lines.append(f"To call several tools at once, separate the calls with {sep}.")
    lines.append("Available tools:")
    for tool in tools:
        desc = f": {tool.description}" if tool.description else ""
        lines.append(f"- {tool.name}{desc}. Arguments (JSON Schema): {json.dumps(tool.parameters)}")
    example = tools[0]
    body = f'{{"name": "{example.name}", "{key}": {{...}}}}'
    lines.append(f"Example call: {fmt.head}{body}{fmt.call_close}{fmt.list_close}")
    return "\n".join(lines)


def template_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """``tools`` in the OpenAI shape that HF chat templates take as ``tools=``."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


#: The tool the probe of :func:`template_renders_tools` offers by default.
_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]


def template_renders_tools(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` (HF's tool-use argument): a
    one-message conversation rendered with ``tools`` (default: one trivial function) differs
    from the same rendered without. A template that raises on ``tools=`` renders none. Used by
    the WebSocket chat sessions and the OpenAI adapter alike."""
    probe = [{"role": "user", "content": "x"}]
    try:
        with_tools = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tools=tools or _PROBE_TOOLS)
        plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that rejects tools= does not render them
        return False
    return with_tools != plain


def tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each ``tool`` message turned into a user message ("Tool result (name):
    content"), for a chat template that refuses the ``tool`` role."""
    return [{"role": "user", "content": f"Tool result ({m.get('name', 'tool')}): {m['content']}"}
            if m["role"] == "tool" else m for m in messages]


def parse_tool_call(text: str, tools: list[ToolSpec]) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` when ``text`` is one complete tool call of a known tool, else None."""
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("arguments"), dict):
        return None
    name = obj.get("name")
    if not any(t.name == name for t in tools):
        return None
    return name, obj["arguments"]
