"""One assistant turn, two transports: a WebSocket chat session and the HTTP chat completions
route plan, constrain and read back a turn the same way (issue 40).

Each family is a tiny model as far as the servers can tell: the default model's tokenizer with
the family's chat template (Hermes / Qwen 3 with ``<think>``; Mistral with ``[TOOL_CALLS]`` as a
special token and a reasoning block), behind a scripted engine that writes one turn: a
reasoning block, then two parallel calls in the family's own format. The test checks, for each
transport, that the engine was asked for the family's native turn grammar, that the scripted
turn is a sentence of that grammar (so a real model under it could write it), and that the
transport hands back the same two calls and the same separated reasoning.
"""
from __future__ import annotations

import json

import pytest

from sgrt.client import Client, Tool

from tests.server.conftest import FakeEngine, running_server
from tests.server.conftest_http import needs_constraints, raw
from .test_family_turns import MISTRAL_LIKE
from .test_tool_formats import QWEN_LIKE, accepts

pytestmark = needs_constraints

# Mistral's template with a reasoning block rendered for assistant messages that carry one.
MISTRAL_THINKING = MISTRAL_LIKE.replace(
    "{% elif m.role == 'assistant' %}{{ m.content }}",
    "{% elif m.role == 'assistant' %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}")

WEATHER_ARGS = {"city": "Paris"}
TIME_ARGS = {"zone": "CET"}
CALLS = [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
THOUGHT = "Two lookups, at once."
TOOLS = [("get_weather", "Current weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                              "required": ["city"], "additionalProperties": False}),
         ("get_time", "Local time", {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                                     "required": ["zone"], "additionalProperties": False})]


def _call_json(name: str, args: dict) -> str:
    return json.dumps({"name": name, "arguments": args})


FAMILIES = {
    # template, added special tokens, the scripted turn, a marker of the native grammar
    "hermes": (QWEN_LIKE, [], f"<think>{THOUGHT}</think>\n\n" + "\n".join(
        f"<tool_call>\n{_call_json(n, a)}\n</tool_call>" for n, a in CALLS), '"<tool_call>'),
    "mistral": (MISTRAL_THINKING, ["[TOOL_CALLS]"], f"<think>{THOUGHT}</think>\n[TOOL_CALLS]["
                + ", ".join(_call_json(n, a) for n, a in CALLS) + "]", "calls: <["),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(name, sgrt Tokenizer with the family's template, scripted turn, grammar marker)."""
    from transformers import AutoTokenizer

    from sgrt.models.loader import DEFAULT_MODEL, tokenizer_folder
    from sgrt.models.tokenizer import Tokenizer

    template, special, script, marker = FAMILIES[request.param]
    hf = AutoTokenizer.from_pretrained(str(tokenizer_folder(DEFAULT_MODEL)), local_files_only=True)
    if special:
        hf.add_special_tokens({"additional_special_tokens": special})
    hf.chat_template = template
    return request.param, Tokenizer(hf), script, marker


async def _over_ws(engine: FakeEngine) -> dict:
    tools = [Tool(name, desc, params) for name, desc, params in TOOLS]
    async with running_server(engine) as server:
        client = await Client.connect(server.url)
        s = await client.session(tools=tools, tool_choice="required", parallel_tool_calls=True,
                                 sampling={"max_tokens": 200})
        reasoning, tokens, deltas, calls, message = "", "", [], [], None
        async for e in s.stream("Weather and time in Paris?", answer_tools=False):
            kind = type(e).__name__
            if kind == "Reasoning":
                reasoning += e.text
            elif kind == "Token":
                tokens += e.text
            elif kind == "ToolCallDelta":
                deltas.append(e)
            elif kind == "Message":
                message = e
            elif kind == "ToolCall":
                calls.append(e)
                if len(calls) == len(CALLS):
                    break  # the server now waits for both tool_results
        await s.close()
        await client.close()
    # the streamed arguments add up to each call's arguments, under the call's id
    for k, call in enumerate(calls):
        mine = [d for d in deltas if d.index == k]
        assert mine[0].name == call.name and {d.call_id for d in mine} == {call.call_id}
        assert json.loads("".join(d.arguments for d in mine)) == call.arguments
    assert message.tool_call.call_id == calls[0].call_id and message.finish_reason == "stop"
    return {"reasoning": reasoning, "content": tokens.strip(),
            "calls": [(c.name, c.arguments) for c in calls], "ids": len({c.call_id for c in calls})}


def _over_http(engine: FakeEngine) -> dict:
    from sgrt.server.http.server import HttpServerThread

    body = {"model": "fake", "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
            "tools": [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
                      for n, d, p in TOOLS],
            "tool_choice": "required", "parallel_tool_calls": True, "max_tokens": 200}
    server = HttpServerThread(engine, model_name="fake").start()
    try:
        status, _, out = raw(server.url, "POST", "/v1/chat/completions", body)
    finally:
        server.stop()
    assert status == 200, out
    choice = out["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    return {"reasoning": msg["reasoning_content"], "content": (msg["content"] or "").strip(),
            "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]],
            "ids": len({c["id"] for c in msg["tool_calls"]})}


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_native_parallel_calls_and_reasoning_on_both_transports(family, transport):
    name, tokenizer, script, marker = family
    engine = FakeEngine(tokenizer, [script])
    got = await _over_ws(engine) if transport == "ws" else _over_http(engine)
    assert got == {"reasoning": THOUGHT, "content": "", "calls": CALLS, "ids": 2}, (name, transport, got)
    # the engine was asked for the family's own turn grammar: a think block, then one or more
    # calls in the native envelope (Mistral's trigger named by its special token's id)
    params = engine.params[-1]
    grammar = params.grammar
    assert marker in grammar and "think[lazy]" in grammar and "call_1" in grammar, grammar
    assert params.skip_special_tokens is False
    from sgrt.constrained import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    assert accepts(compiler, tokenizer, grammar, script)
    # ... and one call only is a sentence too, but not a text answer
    one = script.rsplit("\n<tool_call>", 1)[0] if name == "hermes" else script.split(", {")[0] + "]"
    assert accepts(compiler, tokenizer, grammar, one)
    assert not accepts(compiler, tokenizer, grammar, f"<think>{THOUGHT}</think>\nJust text.")
