"""``tool_use``: pick one function and its arguments, under a union of the tools' schemas.

The call is generated under one JSON Schema, an ``anyOf`` with one
``{"name": <const>, "arguments": <that tool's parameters schema>}`` object per tool, so the
result always names a real tool and its arguments validate against that tool's schema. The
program does not run the tool: the caller does (see ``examples/tool_use_agent.py``).

Over the session server (tools are plain JSON, so clients may send their own)::

    {"type": "session.start", "session": "t1", "program": "tool_use",
     "args": {"request": "What's the weather in Lisbon, in celsius?"}}
"""
from __future__ import annotations

import json
from typing import Any, NotRequired, TypedDict

import sgrt


class FunctionSpec(TypedDict):
    """One tool: the OpenAI function shape, unwrapped (a server checks a client's ``tools``
    against it)."""

    name: str
    description: NotRequired[str]
    parameters: NotRequired[dict[str, Any]]


#: Used when no tools are given: OpenAI-style function specs (name, description, parameters).
DEFAULT_TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 40},
                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"]}},
    {"name": "calculator", "description": "Evaluate an arithmetic expression",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 60}},
                    "required": ["expression"]}},
    {"name": "send_email", "description": "Send a short email",
     "parameters": {"type": "object",
                    "properties": {"to": {"type": "string", "maxLength": 60},
                                   "subject": {"type": "string", "maxLength": 60},
                                   "body": {"type": "string", "maxLength": 120}},
                    "required": ["to", "subject", "body"]}},
]

#: Worked examples for the default tools, shown in the system prompt.
DEFAULT_EXAMPLES = """\
Request: Is it cold in Oslo right now? Use fahrenheit.
Call: {"name":"get_weather","arguments":{"city":"Oslo","unit":"fahrenheit"}}
Request: What is 45 plus 17?
Call: {"name":"calculator","arguments":{"expression":"45 + 17"}}"""


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of one call of any of ``tools``: ``anyOf`` one object per tool, with
    ``name`` fixed to the tool's name and ``arguments`` its ``parameters`` schema.

    Raises:
        ValueError: no tools, a tool without a name, or two tools with the same name.
    """
    if not tools:
        raise ValueError("tool_use needs at least one tool")
    names = [t.get("name") for t in tools]
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"tools need distinct non-empty names, got {names}")
    return {"anyOf": [
        {"type": "object",
         "properties": {"name": {"const": t["name"]},
                        "arguments": t.get("parameters") or {"type": "object", "properties": {}}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools]}


def _describe(tools: list[dict[str, Any]]) -> str:
    """One line per tool: ``- name(arg, arg): description`` (the schema itself is enforced by
    the grammar; a small model reads this short form better than the schema's JSON)."""
    lines = []
    for t in tools:
        args = ", ".join((t.get("parameters") or {}).get("properties", {}))
        lines.append(f"- {t['name']}({args}): {t.get('description', '')}")
    return "\n".join(lines)


@sgrt.function
def tool_use(s, request: str, tools: list[FunctionSpec] | None = None, max_tokens: int = 96):
    """Turn ``request`` into exactly one call of one of ``tools``.

    Inputs:
        request: what the user wants.
        tools: ``[{"name", "description", "parameters": <JSON Schema of the arguments>}]``
            (the OpenAI function shape, unwrapped); default :data:`DEFAULT_TOOLS` (which come
            with worked examples in the system prompt, :data:`DEFAULT_EXAMPLES`).
        max_tokens: the most tokens of the call.

    Variables:
        ``call``: the call's JSON text, ``{"name": ..., "arguments": {...}}``;
        ``name``: the tool's name; ``arguments``: the parsed arguments (both ``None`` if
        ``max_tokens`` cut the call short).

    Shows: a union (``anyOf``) of JSON Schemas with ``const`` discriminators, as function
    calling needs it.

    Raises:
        ValueError: see :func:`call_schema`.
    """
    tools = DEFAULT_TOOLS if tools is None else list(tools)
    schema = call_schema(tools)
    s += sgrt.system("You call functions. Reply with one JSON object "
                     '{"name": <function name>, "arguments": {...}} and nothing else.\nFunctions:\n'
                     + _describe(tools) + ("\n\nExamples:\n" + DEFAULT_EXAMPLES if tools == DEFAULT_TOOLS else ""))
    s += sgrt.user(request)
    s += sgrt.assistant(sgrt.gen("call", json_schema=schema, max_tokens=max_tokens))
    try:
        call = json.loads(s["call"])
    except ValueError:  # NOTE: only a call cut short by max_tokens fails to parse
        call = {"name": None, "arguments": None}
    s["name"] = call["name"]
    s["arguments"] = call["arguments"]
