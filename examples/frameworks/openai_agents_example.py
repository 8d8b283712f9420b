"""The OpenAI Agents SDK against sgrt, with its default model (the Responses API): a plain
answer, a function tool, a structured output type, and a streamed run.

Every run happens on one event loop: the default ``AsyncOpenAI`` client keeps an HTTP
connection pool bound to the loop it was first used on, so ``Runner.run_sync`` followed by
``asyncio.run(...)`` of a streamed run fails ("Event loop is closed") with any server.

    pip install openai-agents && sgrt serve &   python examples/frameworks/openai_agents_example.py
"""
from __future__ import annotations

import asyncio

from _report import BASE_URL, MODEL, acheck
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI
from pydantic import BaseModel

set_default_openai_client(AsyncOpenAI(base_url=BASE_URL, api_key="unused"), use_for_tracing=False)
set_tracing_disabled(True)
SETTINGS = ModelSettings(temperature=0, max_tokens=40)


@function_tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"sunny, 21 C in {city}"


class City(BaseModel):
    name: str
    country: str


async def text() -> str:
    agent = Agent(name="plain", instructions="Answer in one short sentence.", model=MODEL, model_settings=SETTINGS)
    out = (await Runner.run(agent, "Name a colour.")).final_output
    assert isinstance(out, str) and out
    return out


async def tool() -> str:
    settings = ModelSettings(temperature=0, max_tokens=40, tool_choice="required")
    agent = Agent(name="weather", instructions="Use get_weather.", model=MODEL, tools=[get_weather],
                  model_settings=settings)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    assert calls, "no tool call"
    return str(result.final_output)


async def structured() -> City:
    agent = Agent(name="city", instructions="Reply with a city.", model=MODEL, output_type=City,
                  model_settings=SETTINGS)
    out = (await Runner.run(agent, "Name the capital of France.")).final_output
    assert isinstance(out, City)
    return out


async def streamed() -> str:
    agent = Agent(name="s", instructions="Answer briefly.", model=MODEL, model_settings=SETTINGS)
    result = Runner.run_streamed(agent, "Say hi.")
    deltas = [e async for e in result.stream_events() if e.type == "raw_response_event"
              and getattr(e.data, "type", "") == "response.output_text.delta"]
    assert deltas, "no text deltas"
    assert result.final_output == "".join(e.data.delta for e in deltas)
    return str(result.final_output)


async def main() -> None:
    for name, fn in [("text", text), ("tools", tool), ("structured", structured), ("stream", streamed)]:
        await acheck(name, fn)


if __name__ == "__main__":
    asyncio.run(main())
