"""pydantic-ai against sgrt: its default output mode (a tool call carrying the output type,
here a nested Pydantic model), a function tool (forced on the first step), and streamed text.

    pip install pydantic-ai-slim[openai] && sgrt serve &   python examples/frameworks/pydantic_ai_example.py
"""
from __future__ import annotations

from dataclasses import dataclass

from _report import BASE_URL, MODEL, check
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.providers.openai import OpenAIProvider

try:
    from pydantic_ai.models.openai import OpenAIChatModel as ChatModel
except ImportError:  # older releases
    from pydantic_ai.models.openai import OpenAIModel as ChatModel

model = ChatModel(MODEL, provider=OpenAIProvider(base_url=BASE_URL, api_key="unused"))
SETTINGS = {"temperature": 0, "max_tokens": 60}


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    address: Address


def output() -> Person:
    agent = Agent(model, output_type=Person, model_settings=SETTINGS)
    out = agent.run_sync("Ann lives in Oslo, Norway. Extract the person.").output
    assert isinstance(out.address, Address)
    return out


@dataclass
class CallFirst(AbstractCapability):
    """Forces a call of ``tool`` on the run's first step only (pydantic-ai refuses a static
    forcing ``tool_choice``, which would never let the run finish): a 135M model left to
    ``auto`` tends to answer in text."""

    tool: str = "get_weather"

    def get_model_settings(self):
        return lambda ctx: {"tool_choice": [self.tool]} if ctx.run_step <= 1 else {}


def tool() -> str:
    agent = Agent(model, model_settings=SETTINGS, capabilities=[CallFirst()])
    called = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        called.append(city)
        return "sunny"

    result = agent.run_sync("What is the weather in Paris? Use get_weather.")
    assert called, "the tool was not called"
    return result.output


def stream() -> str:
    import asyncio

    async def run() -> str:
        agent = Agent(model, model_settings={"temperature": 0, "max_tokens": 8})
        async with agent.run_stream("Say hi.") as result:
            parts = [t async for t in result.stream_text(delta=True)]
        assert parts
        return "".join(parts)

    return asyncio.run(run())


if __name__ == "__main__":
    for name, fn in [("structured", output), ("tools", tool), ("stream", stream)]:
        check(name, fn)
