"""An agent with two local tools talking to the sgrt session server over WebSocket.

The tools run here, in the client: ``calculator`` (arithmetic, evaluated from a parsed syntax
tree, never with ``eval``) and ``search_notes`` (keyword search over ``ws_agent_notes.txt``,
next to this file). The server generates each assistant turn under a grammar that allows free
text or exactly one call of one of these tools, with arguments matching its JSON Schema.

Run against a running server (``sgrt serve --port 8765``)::

    python examples/ws_agent.py --url ws://127.0.0.1:8765

or, without ``--url``, with an in-process server on a free loopback port and the default model::

    python examples/ws_agent.py

The default model is small (135M parameters): it does not always choose a tool when it should;
the grammar only guarantees that when it does, the call is well formed.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from programs.react import calculator  # noqa: E402  (the ReAct program's safe arithmetic tool)
from sgrt.client import Client, ServerError, Tool  # noqa: E402

NOTES = Path(__file__).with_name("ws_agent_notes.txt")


def search_notes(query: str, limit: int = 2) -> str:
    """The lines of the notes file that share the most words (3+ letters) with ``query``."""
    words = {w for w in re.findall(r"[a-z0-9]+", query.lower()) if len(w) >= 3}
    scored = []
    for line in NOTES.read_text(encoding="utf-8").splitlines():
        hits = len(words & set(re.findall(r"[a-z0-9]+", line.lower())))
        if hits:
            scored.append((hits, line.strip()))
    scored.sort(key=lambda x: -x[0])
    return "\n".join(line for _, line in scored[:limit]) or "no matching notes"


TOOLS = [
    Tool("calculator", "Evaluate an arithmetic expression such as 17 * 23",
         {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 80}},
          "required": ["expression"]}, handler=calculator),
    Tool("search_notes", "Search the notes for facts about a topic",
         {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60}},
          "required": ["query"]}, handler=search_notes),
]

# (question, tool_choice). "required" makes this turn's first reply a call of some tool (the
# model picks which, and its arguments); a tool's name asks for a call of that tool; "auto" lets
# the model choose text or a call. A 135M model rarely chooses a call on its own, and after a
# tool result it tends to repeat the call, so the demo asks for a call where it wants one and
# answers each tool result with tool_choice="none" (a text answer now).
QUESTIONS = [
    ("Use the calculator: what is 17 * 23?", "required"),
    ("Search the notes: how tall is the Eiffel Tower?", "search_notes"),
    ("Thanks! Say goodbye in one short sentence.", "auto"),
]


async def run_agent(url: str, questions: list[tuple[str, str]], max_tokens: int,
                    auth_token: str | None = None) -> list:
    """Ask each question in its own session (all on one connection: a small model answers
    better without earlier calls to copy); print tokens, tool calls and results; return the
    ``message`` events."""
    replies = []
    async with await Client.connect(url, auth_token=auth_token) as client:
        for q, tool_choice in questions:
            session = await client.session(
                tools=TOOLS, sampling={"max_tokens": max_tokens},
                system="You are a concise assistant. Use a tool when the user asks for one.")
            print(f"\nuser> {q}\nassistant> ", end="", flush=True)
            try:
                async for event in session.stream(q, answer_tools=False, tool_choice=tool_choice):
                    kind = type(event).__name__
                    if kind == "Token":
                        print(event.text, end="", flush=True)
                    elif kind == "ToolCall":  # run the tool here, on the client, and answer
                        tool = next(t for t in TOOLS if t.name == event.name)
                        result = _safe(tool.handler, event.arguments)
                        print(f"[{event.name}({event.arguments}) -> {result!r}] ", end="", flush=True)
                        await session.answer(event.call_id, result, tool_choice="none")
                    elif kind == "Message":
                        replies.append(event)
                        what = "tool call" if event.tool_call else event.finish_reason
                        print(f"\n  ({what}: {event.completion_tokens} tokens, ttft {1000 * (event.ttft or 0):.0f} ms, "
                              f"{event.cached_tokens}/{event.prompt_tokens} prompt tokens cached)\n  ", end="")
            except ServerError as e:
                print(f"\n  server error: {e}")
            await session.close()
        print()
    return replies


def _safe(fn, arguments: dict) -> str:
    try:
        return fn(**arguments)
    except Exception as e:  # noqa: BLE001 - shown, as the session sends it to the model
        return f"error: {e}"


async def main_async(args: argparse.Namespace) -> None:
    if args.url:
        await run_agent(args.url, QUESTIONS, args.max_tokens, args.auth_token)
        return
    from sgrt.engine import Engine
    from sgrt.server import serve_ws

    engine = Engine()
    try:
        server = await serve_ws(engine, host="127.0.0.1", port=0)
        try:
            await run_agent(server.url, QUESTIONS, args.max_tokens)
        finally:
            await server.close()
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="ws://host:port of a running server (default: start one in-process)")
    ap.add_argument("--auth-token", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
