"""langchain-openai against sgrt: with_structured_output (its default method and
function_calling) and bind_tools.

    pip install langchain-openai && sgrt serve &   python examples/frameworks/langchain_example.py
"""
from __future__ import annotations

from _report import BASE_URL, MODEL, check
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

llm = ChatOpenAI(model=MODEL, base_url=BASE_URL, api_key="unused", temperature=0, max_tokens=60)


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    address: Address


@tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return "sunny"


def structured(method: str | None) -> Person:
    kw = {"method": method} if method else {}
    out = llm.with_structured_output(Person, **kw).invoke("Ann lives in Oslo, Norway. Extract the person.")
    assert isinstance(out, Person)
    return out


def tools() -> list:
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    return msg.tool_calls


def stream() -> str:
    text = "".join(chunk.content for chunk in llm.stream("Say hi."))
    assert text
    return text


if __name__ == "__main__":
    check("structured", lambda: structured(None))
    check("structured (function_calling)", lambda: structured("function_calling"))
    check("tools", tools)
    check("stream", stream)
