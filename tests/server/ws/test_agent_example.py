"""examples/ws_agent.py: its two local tools, and the agent loop against the real server (on a
scripted engine, so that the tool path is taken)."""
from __future__ import annotations

import pytest

from examples.ws_agent import QUESTIONS, calculator, run_agent, search_notes
from tests.server.conftest import FakeEngine, running_server


def test_calculator_evaluates_arithmetic_only():
    assert calculator("17 * 23") == "391"
    assert calculator("(1 + 2) ** 3 - 4 / 2") == "25"
    assert calculator("-2^3") == "-8"
    assert calculator("7 / 2") == "3.5"
    for bad in ["__import__('os').system('true')", "abs(-1)", "x + 1", "2 ** 1000", "'a' * 3", "1" * 201]:
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


def test_search_notes_finds_the_matching_line():
    assert "330 metres" in search_notes("How tall is the Eiffel Tower?")
    assert "8849" in search_notes("everest height")
    assert search_notes("zzzz qqqq") == "no matching notes"


async def test_agent_runs_both_tools_through_the_server(tokenizer, capsys):
    engine = FakeEngine(tokenizer, [
        '{"name": "calculator", "arguments": {"expression": "17 * 23"}}', "It is 391.",
        '{"name": "search_notes", "arguments": {"query": "Eiffel Tower tall"}}', "About 330 metres.",
        "Goodbye!",
    ])
    async with running_server(engine) as server:
        replies = await run_agent(server.url, QUESTIONS, max_tokens=48)
    out = capsys.readouterr().out
    assert "[calculator({'expression': '17 * 23'}) -> '391']" in out
    assert "search_notes" in out and "330 metres" in out
    assert [r.content for r in replies if r.tool_call is None] == ["It is 391.", "About 330 metres.", "Goodbye!"]
    assert "391" in tokenizer.decode(engine.prompts[1], skip_special_tokens=False)
