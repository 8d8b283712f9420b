"""The anthropic SDK against sgrt's Messages API: text, a tool_use / tool_result round trip, and
a streamed reply.

    pip install anthropic && sgrt serve &   python examples/frameworks/anthropic_example.py
"""
from __future__ import annotations

import anthropic
from _report import BASE_URL, MODEL, check

client = anthropic.Anthropic(base_url=BASE_URL.removesuffix("/v1"), api_key="unused")
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def text() -> str:
    m = client.messages.create(model=MODEL, max_tokens=16, system="Answer briefly.",
                               messages=[{"role": "user", "content": "Name a colour."}])
    return m.content[0].text


def tools() -> str:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], tool_choice={"type": "any"},
                               messages=msgs)
    use = next(b for b in m.content if b.type == "tool_use")
    msgs += [{"role": "assistant", "content": m.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    final = client.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], messages=msgs)
    return final.content[0].text if final.content else ""


def stream() -> str:
    with client.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Say hi."}]) as s:
        out = "".join(s.text_stream)
    assert out
    return out


if __name__ == "__main__":
    for name, fn in [("text", text), ("tools", tools), ("stream", stream)]:
        check(name, fn)
