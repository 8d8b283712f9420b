"""Function calling with ``programs/tool_use.py``: the model picks one function and its
arguments under a union of the functions' JSON Schemas; this script runs it.

    python examples/tool_use_agent.py [--model PATH]

Shows: an ``anyOf`` of ``{"name": <const>, "arguments": <schema>}`` objects as one constraint
(the call always names a real function and its arguments always validate); the functions are
Python callables that run here, never code from the model.
"""
from __future__ import annotations

import time

from _common import describe, finish, parse_args, start

from programs.react import calculator
from programs.tool_use import DEFAULT_TOOLS, tool_use


def get_weather(city: str, unit: str) -> str:
    """A stand-in weather service (no network): always mild."""
    return f"{city}: 18 degrees {unit}, light wind" if unit == "celsius" else f"{city}: 64 degrees {unit}, light wind"


def send_email(to: str, subject: str, body: str) -> str:
    """A stand-in mailer: prints instead of sending."""
    return f"(not sent) to={to!r} subject={subject!r} body={body[:40]!r}"


FUNCTIONS = {"get_weather": get_weather, "calculator": calculator, "send_email": send_email}
REQUESTS = ["What's the weather in Lisbon, in celsius?", "What is 1234 * 5678?",
            "Email bob@example.com that the meeting moved to 3pm."]


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    rt = start(args)
    t0 = time.perf_counter()
    for request in REQUESTS:
        st = tool_use.run(request=request, tools=DEFAULT_TOOLS)
        print(f"\nrequest: {request}\ncall:    {st['call']}")
        if st["name"] is not None:
            try:
                result = FUNCTIONS[st["name"]](**st["arguments"])
            except Exception as e:  # noqa: BLE001 - a bad argument value, shown
                result = f"error: {e}"
            print(f"result:  {result}")
        print(f"  ({describe(st.get_meta_info('call'))})")
    finish(rt, t0)


if __name__ == "__main__":
    main()
