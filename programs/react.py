"""``react``: a ReAct agent loop (reason, act, observe) with tools and a step limit.

Each step the model writes a one-line thought, then an action, generated under a JSON Schema
that is the union (``anyOf``) of ``{"tool": <name>, "input": <string>}`` for every tool and
``{"tool": "finish", "input": <the answer>}``. So every action parses, names a real tool, and
the Python loop can call it. The tools are Python callables the caller passes in: the program
never executes text the model (or a client) wrote. On the last allowed step the schema admits
only ``finish``, so the loop always ends with an answer within ``max_steps``.

Over the session server a client can pass only JSON, so it gets the default tools
(:func:`default_tools`: a calculator and a search over ``notes``)::

    {"type": "session.start", "session": "r1", "program": "react",
     "args": {"question": "What is 17 * 23?", "max_steps": 3}}
"""
from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

import sgrt

FINISH = "finish"
MAX_INPUT_CHARS = 60
MAX_ANSWER_CHARS = 120
MAX_OBSERVATION_CHARS = 300
#: Enough tokens for the longest action (a finish answer of MAX_ANSWER_CHARS characters and the
#: JSON around it), so that an action is cut short only by unusual escapes.
ACTION_MAX_TOKENS = MAX_ANSWER_CHARS + 40
#: One line of thought: a space (the prompt ends at "Thought 1:" so that the model's usual
#: " I" token stays whole), a letter, up to 119 more characters, the newline.
THOUGHT_REGEX = r" [A-Za-z][^\n]{0,119}\n"

DEFAULT_NOTES = """\
The Eiffel Tower in Paris is about 330 metres tall and was finished in 1889.
Mount Everest is 8849 metres high and lies on the border of Nepal and China.
The Amazon river carries more water than any other river on Earth.
A marathon is 42.195 kilometres long.
Water boils at 100 degrees Celsius at sea level."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate arithmetic such as 17 * 23 (numbers, + - * / // % ** and parentheses; x and ^ read as * and **).

    Parsed into a syntax tree and evaluated node by node, never with ``eval``.

    Raises:
        ValueError: anything but arithmetic, an exponent above 100, over 200 characters.
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent larger than 100")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        value = ev(ast.parse(expression.replace("^", "**").replace("x", "*"), mode="eval"))
    except SyntaxError as e:
        raise ValueError(f"not arithmetic: {e.msg}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def make_search(notes: str) -> Callable[[str], str]:
    """A search tool over ``notes`` (one fact per line): the lines sharing most words with the query."""

    def search(query: str) -> str:
        """Search the notes for facts about a topic."""
        words = {w for w in re.findall(r"[a-z0-9]+", query.lower()) if len(w) >= 3}
        scored = []
        for line in notes.splitlines():
            hits = len(words & set(re.findall(r"[a-z0-9]+", line.lower())))
            if hits:
                scored.append((hits, line.strip()))
        scored.sort(key=lambda x: -x[0])
        return "\n".join(line for _, line in scored[:2]) or "no matching notes"

    return search


#: A worked example for the default tools, shown in the system prompt.
DEFAULT_EXAMPLE = """\
Question: How tall is Mount Everest in feet?
Thought 1: I should search the notes for the height of Mount Everest.
Action 1: {"tool":"search","input":"Mount Everest height"}
Observation 1: Mount Everest is 8849 metres high and lies on the border of Nepal and China.
Thought 2: I convert metres to feet with the calculator.
Action 2: {"tool":"calculator","input":"8849 * 3.281"}
Observation 2: 29033.569
Thought 3: I know the answer now.
Action 3: {"tool":"finish","input":"About 29034 feet."}"""


def default_tools(notes: str | None = None) -> dict[str, Callable[[str], str]]:
    """``calculator`` and ``search`` (over ``notes``, default :data:`DEFAULT_NOTES`)."""
    return {"calculator": calculator, "search": make_search(DEFAULT_NOTES if notes is None else notes)}


def action_schema(tool_names: list[str], allow_tools: bool = True) -> dict[str, Any]:
    """JSON Schema of one action: ``anyOf`` one object per tool (``input`` up to
    :data:`MAX_INPUT_CHARS`) and the ``finish`` object (``input`` up to :data:`MAX_ANSWER_CHARS`).
    With ``allow_tools=False`` only ``finish``."""

    def one(name: str, max_chars: int) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"tool": {"const": name}, "input": {"type": "string", "maxLength": max_chars}},
                "required": ["tool", "input"], "additionalProperties": False}

    options = [one(n, MAX_INPUT_CHARS) for n in tool_names] if allow_tools else []
    return {"anyOf": options + [one(FINISH, MAX_ANSWER_CHARS)]}


def _describe(tools: Mapping[str, Callable[..., Any]]) -> str:
    lines = []
    for name, fn in tools.items():
        doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
        lines.append(f"- {name}: {doc[0] if doc else 'a tool'}")
    lines.append(f"- {FINISH}: give the final answer as input")
    return "\n".join(lines)


def _run_tool(fn: Callable[[str], Any], arg: str) -> str:
    try:
        out = fn(arg)
    except Exception as e:  # noqa: BLE001 - the model sees the error and may try again
        out = f"error: {e}"
    return " ".join(str(out).split())[:MAX_OBSERVATION_CHARS]


@sgrt.function
def react(s, question: str, tools: Mapping[str, Callable[[str], Any]] | None = None, max_steps: int = 4,
          notes: str | None = None, example: str | None = None, thought_tokens: int = 32):
    """Answer ``question`` by alternating thoughts, tool calls and observations.

    Inputs:
        question: what to answer.
        tools: name -> callable taking one string and returning text (its docstring's first
            line describes it to the model); default :func:`default_tools` (``notes``).
            A tool that raises gives the observation ``error: ...``.
        max_steps: the most actions (>= 1); the last one is always ``finish``.
        notes: the text the default ``search`` tool searches.
        example: a worked example shown in the system prompt (default: one that uses tools
            named ``search`` and ``calculator``, :data:`DEFAULT_EXAMPLE`, when those are the
            tools; none otherwise).
        thought_tokens: the most tokens of each thought.

    Variables:
        ``thought_i`` (one line, ending in a newline unless cut short) and ``action_i`` (the
        action's JSON text) for each step ``i``;
        ``actions``: the parsed actions (``{"tool", "input"}``); ``observations``: the tools'
        outputs (one per tool call); ``steps``: how many actions; ``answer``: the finish input
        (``None`` only if an action was cut short).

    Shows: a Python control loop over generated values, JSON Schema union constraints, tools as
    Python callables, a step limit enforced by narrowing the grammar.

    Raises:
        ValueError: ``max_steps`` < 1, a tool named ``finish``.
    """
    tools = default_tools(notes) if tools is None else dict(tools)
    if example is None and set(tools) == set(default_tools()):
        example = DEFAULT_EXAMPLE
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if FINISH in tools:
        raise ValueError(f"a tool may not be named {FINISH!r}")
    names = list(tools)
    s += sgrt.system(
        "You answer questions step by step. Each step: a short thought, then one action as JSON "
        '{"tool": <name>, "input": <text>}. After each tool call you see its observation. '
        'When you know the answer, use {"tool": "finish", "input": <answer>}.\nTools:\n' + _describe(tools)
        + ("\n\nExample:\n" + example if example else ""))
    s += sgrt.user(question)
    actions: list[dict[str, Any]] = []
    observations: list[str] = []
    answer = None
    with s.assistant():
        for i in range(max_steps):
            last = i == max_steps - 1
            # NOTE: a regex, not stop="\n": the small model often ends the line at once, and an
            # empty thought helps nobody. The thought ends at its newline (or after 120 chars).
            s += f"Thought {i + 1}:" + sgrt.gen(f"thought_{i}", regex=THOUGHT_REGEX, max_tokens=thought_tokens)
            if not s[f"thought_{i}"].endswith("\n"):  # cut short by thought_tokens
                s += "\n"
            schema = action_schema(names, allow_tools=not last)
            s += f"Action {i + 1}: " + sgrt.gen(f"action_{i}", json_schema=schema, max_tokens=ACTION_MAX_TOKENS) + "\n"
            try:
                action = json.loads(s[f"action_{i}"])
            except ValueError:  # cut short by max_tokens: stop here
                break
            actions.append(action)
            if action["tool"] == FINISH:
                answer = action["input"]
                break
            observation = _run_tool(tools[action["tool"]], action["input"])
            observations.append(observation)
            s += f"Observation {i + 1}: " + observation + "\n"
    s["actions"] = actions
    s["observations"] = observations
    s["steps"] = len(actions)
    s["answer"] = answer
