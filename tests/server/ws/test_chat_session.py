"""Tool calls over the session protocol.

The flow (tool_call -> client runs the tool -> tool_result -> the turn continues) is checked on
a scripted engine, since a 135M model cannot be relied on to choose a tool; the grammar on the
real model is checked for shape: whatever it chooses is free text or one valid call.
"""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from sgrt.client import AgentSession, Client, ServerError, Tool
from sgrt.server import WsLimits
from tests.server.conftest import FakeEngine, running_server

CALC_SCHEMA = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 40}},
               "required": ["expression"]}
SEARCH_SCHEMA = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
                 "required": ["query"]}


def calc_tool(calls: list) -> Tool:
    def calculator(expression: str) -> str:
        calls.append(expression)
        return "391"

    return Tool("calculator", "Evaluate arithmetic", CALC_SCHEMA, handler=calculator)


async def test_tool_call_round_trip(tokenizer):
    engine = FakeEngine(tokenizer, [
        '{"name": "calculator", "arguments": {"expression": "17 * 23"}}',
        "17 * 23 is 391.",
        "You are welcome.",
    ])
    calls: list[str] = []
    async with running_server(engine) as server:
        async with await AgentSession.connect(server.url, tools=[calc_tool(calls)],
                                              sampling={"max_tokens": 40}) as s:
            assert s.ready.tools == ["calculator"]
            streamed = [e async for e in s.stream("What is 17 * 23?")]
            # the call is not streamed as tokens but as tool_call.delta (name first, then the
            # arguments' JSON text in fragments); the answer after the tool result is
            deltas = [e for e in streamed if type(e).__name__ == "ToolCallDelta"]
            assert deltas[0].name == "calculator" and deltas[0].call_id == "call-1" and deltas[0].arguments == ""
            assert "".join(d.arguments for d in deltas) == '{"expression": "17 * 23"}'
            assert {d.index for d in deltas} == {0} and all(d.name == "" for d in deltas[1:])
            events = [e for e in streamed if type(e).__name__ != "ToolCallDelta"]
            kinds = [type(e).__name__ for e in events]
            assert kinds[:2] == ["Message", "ToolCall"], kinds
            assert kinds[-1] == "Done" and events[-1].reason == "turn"
            first, call = events[0], events[1]
            assert first.tool_call is not None and first.tool_call.name == "calculator"
            assert call.arguments == {"expression": "17 * 23"} and call.turn == 1
            assert calls == ["17 * 23"]
            tokens = "".join(e.text for e in events if type(e).__name__ == "Token")
            assert tokens == "17 * 23 is 391." == events[-2].content and events[-2].turn == 2
            reply = await s.send("Thanks!")
            assert reply.text == "You are welcome." and not reply.tool_calls
    # every turn ran under the tool grammar; the tool's result reached the model's prompt
    assert all(p.grammar and "call_0" in p.grammar and '"calculator"' in p.grammar for p in engine.params)
    second_prompt = tokenizer.decode(engine.prompts[1], skip_special_tokens=False)
    assert "391" in second_prompt and "calculator" in second_prompt
    # ...and the conversation grows by exact token extension (prefix cache friendly)
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]
    assert engine.prompts[2][: len(engine.prompts[1])] == engine.prompts[1]


async def test_tool_call_without_a_handler_and_manual_answers(tokenizer):
    engine = FakeEngine(tokenizer, ['{"name": "search", "arguments": {"query": "tower"}}', "330 metres."])
    tools = [Tool("search", "Search notes", SEARCH_SCHEMA)]  # no handler: answered by hand
    async with running_server(engine) as server:
        async with await AgentSession.connect(server.url, tools=tools) as s:
            with pytest.raises(ServerError) as info:
                await s.send("How tall?")
            assert info.value.code == "unknown_call"
            # the call is still open: a user message is refused until it is answered
            with pytest.raises(ServerError) as info:
                async for _ in s.stream("hello?"):
                    pass
            assert info.value.code == "bad_state"
            call_id = "call-1"
            await s.answer(call_id, {"result": "The Eiffel Tower is about 330 metres tall."})
            events = [e async for e in s._events(answer_tools=False)]
            assert events[-1].reason == "turn" and events[-2].content == "330 metres."
    assert '{"result": "The Eiffel Tower' in tokenizer.decode(engine.prompts[1], skip_special_tokens=False)


async def test_tool_rounds_are_limited(tokenizer):
    call = '{"name": "calculator", "arguments": {"expression": "1+1"}}'
    engine = FakeEngine(tokenizer, [call] * 5)
    async with running_server(engine, limits=WsLimits(max_tool_rounds=2)) as server:
        async with await AgentSession.connect(server.url, tools=[calc_tool([])]) as s:
            with pytest.raises(ServerError) as info:
                await s.send("loop forever")
            assert info.value.code == "limit.tools"
    assert len(engine.prompts) == 3


async def test_cancel_while_a_tool_call_is_open(tokenizer):
    engine = FakeEngine(tokenizer, ['{"name": "search", "arguments": {"query": "x"}}', "fine."])
    async with running_server(engine) as server:
        async with await AgentSession.connect(server.url, tools=[Tool("search", "", SEARCH_SCHEMA)]) as s:
            events = []
            async for e in s.stream("q", answer_tools=False):
                events.append(e)
                if type(e).__name__ == "ToolCall":
                    break
            await s.cancel()
            done = await asyncio.wait_for(s._next(), 5)
            assert done.reason == "cancelled"
            reply = await s.send("next question")
            assert reply.text == "fine."


def _constrained_available() -> bool:
    try:
        from sgrt.constrained import GrammarCompiler  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _constrained_available(), reason="sgrt.constrained.GrammarCompiler not available yet")
async def test_real_model_turns_under_the_tool_grammar(ws_engine):
    """On the default model: "required" yields one call whose arguments match the tool's schema
    (the grammar guarantees it); "auto" yields text or one valid call; "none" yields text."""
    from examples.ws_agent import TOOLS

    schemas = {t.name: t.parameters for t in TOOLS}
    specs = [Tool(t.name, t.description, t.parameters) for t in TOOLS]
    async with running_server(ws_engine) as server:
        client = await Client.connect(server.url)
        for q, choice in [("Use the calculator to compute 12 * 7.", "required"),
                          ("Search the notes for the Eiffel Tower.", "search_notes"),
                          ("Search the notes for the Eiffel Tower.", "auto"),
                          ("Say hello.", "none")]:
            s = await client.session(tools=specs, sampling={"max_tokens": 48})
            events = []
            async for e in s.stream(q, answer_tools=False, tool_choice=choice):
                if type(e).__name__ not in ("Token", "ToolCallDelta", "Reasoning"):
                    events.append(e)
                if type(e).__name__ == "ToolCall":
                    break  # the server now waits for our tool_result
            msg = events[0]
            if choice in ("required", "search_notes"):
                assert msg.finish_reason == "stop" and msg.tool_call is not None, msg
            if choice == "search_notes":
                assert msg.tool_call.name == "search_notes"
            if choice == "none":
                assert msg.tool_call is None and not msg.content.startswith("{")
            if msg.tool_call is not None:
                assert type(events[1]).__name__ == "ToolCall" and events[1].arguments == msg.tool_call.arguments
                jsonschema.validate(msg.tool_call.arguments, schemas[msg.tool_call.name])
                assert json.loads(msg.content) == {"name": msg.tool_call.name, "arguments": msg.tool_call.arguments}
                await s.answer(msg.tool_call.call_id, "84", tool_choice="none")
                rest = [e async for e in s._events(answer_tools=False)]
                assert rest[-1].reason == "turn"
                answer = next(e for e in rest if type(e).__name__ == "Message")
                assert answer.tool_call is None and not answer.content.startswith("{")
                assert answer.cached_tokens >= msg.prompt_tokens  # the call stayed in the cache
            else:
                assert not msg.content.startswith("{") and events[-1].reason == "turn"
            await s.close()
        await client.close()
