"""programs/react.py: actions validate against the action schema, tools are the caller's
callables, and the loop ends with ``finish`` within the step limit."""
from __future__ import annotations

import jsonschema
import pytest

from programs.react import FINISH, action_schema, calculator, default_tools, make_search, react


class Recorder:
    """A tool that records its calls."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__
        self.calls: list[str] = []

    def __call__(self, arg: str) -> str:
        self.calls.append(arg)
        return self.fn(arg)


def check_run(st, tools, max_steps):
    actions, observations = st["actions"], st["observations"]
    steps = st["steps"]
    assert 1 <= steps <= max_steps and len(actions) == steps
    schema = action_schema(list(tools))
    for i, action in enumerate(actions):
        jsonschema.validate(action, schema)
        assert action == __import__("json").loads(st[f"action_{i}"])
        assert st[f"thought_{i}"].startswith(" ")
    # Every non-final action called the named tool with its input, and its output was observed.
    tool_actions = [a for a in actions if a["tool"] != FINISH]
    calls = [(name, arg) for name, t in tools.items() for arg in t.calls]
    assert sorted(calls) == sorted((a["tool"], a["input"]) for a in tool_actions)
    assert len(observations) == len(tool_actions)
    text = st.text()
    for i, obs in enumerate(observations):
        assert f"Observation {i + 1}: {obs}\n" in text
    # The last allowed step admits only finish: the run always ends with an answer.
    assert actions[-1]["tool"] == FINISH and st["answer"] == actions[-1]["input"]
    assert all(a["tool"] != FINISH for a in actions[:-1])


def test_loop_with_recorded_tools_and_a_step_limit(runtime):
    tools = {"calculator": Recorder(calculator), "search": Recorder(make_search("Mount Everest is 8849 metres high."))}
    st = react.run(question="How tall is Mount Everest in feet?", tools=tools, max_steps=3, thought_tokens=16)
    check_run(st, tools, 3)


def test_one_step_is_always_finish(runtime):
    tools = {"calculator": Recorder(calculator)}
    st = react.run(question="What is 6 * 7?", tools=tools, max_steps=1, thought_tokens=8)
    assert st["steps"] == 1 and st["actions"][0]["tool"] == FINISH and tools["calculator"].calls == []
    assert isinstance(st["answer"], str) and st["observations"] == []
    # The action was generated under the finish-only schema: forced tokens were jumped over.
    assert st.get_meta_info("action_0")["forced_tokens"] >= 3


def test_action_schema_is_a_union_with_finish():
    schema = action_schema(["calculator", "search"])
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate({"tool": "search", "input": "x"}, schema)
    jsonschema.validate({"tool": FINISH, "input": "done"}, schema)
    for bad in [{"tool": "rm", "input": "x"}, {"tool": "search"}, {"tool": "search", "input": "x", "y": 1}]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool": "search", "input": "x"}, action_schema(["search"], allow_tools=False))


def test_tools_are_safe_and_errors_become_observations():
    assert calculator("17 * 23") == "391" and calculator("2 ^ 10") == "1024" and calculator("3 x 4") == "12"
    for bad in ["__import__('os')", "abs(-1)", "a + 1", "2 ** 1000", "'a' * 3"]:
        with pytest.raises(ValueError):
            calculator(bad)
    assert "8849" in default_tools()["search"]("everest height")
    assert default_tools("")["search"]("anything") == "no matching notes"
    from programs.react import _run_tool

    assert _run_tool(calculator, "os.system('x')").startswith("error: ")


def test_bad_arguments_raise(runtime):
    with pytest.raises(ValueError, match="max_steps"):
        react.run(question="q", max_steps=0)
    with pytest.raises(ValueError, match="finish"):
        react.run(question="q", tools={"finish": calculator})
