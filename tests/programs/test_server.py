"""The session server serves every program in programs/: the registry discovers them all, and
programs run over a real loopback server (on the session's engine) with JSON arguments only."""
from __future__ import annotations

import jsonschema

from programs.react import FINISH, action_schema
from programs.tool_use import DEFAULT_TOOLS, call_schema
from sgrt.client import Client
from sgrt.server.ws.programs import ProgramRegistry
from tests.server.conftest import PROGRAMS_DIR, running_server, wait_engine_idle

PROGRAMS = ["chat", "classify", "echo_summary", "extract", "parallel_judge", "react",
            "skeleton_of_thought", "tool_use"]


def test_registry_discovers_every_program_with_a_docstring():
    registry = ProgramRegistry.from_dir(PROGRAMS_DIR)
    assert registry.errors == {}
    assert registry.names() == PROGRAMS
    for name in PROGRAMS:
        program = registry.get(name)
        assert program.__doc__ and len(program.__doc__.strip()) > 40, name
        assert registry.sources[name].endswith(f"{name}.py")


async def test_programs_run_over_a_loopback_server(runtime):
    engine = runtime.engine
    async with running_server(engine, programs_dir=PROGRAMS_DIR) as server:
        assert server.registry.names() == PROGRAMS
        client = await Client.connect(server.url)
        try:
            # one function call under a union of schemas, arguments from JSON
            s = await client.session(program="tool_use",
                                     args={"request": "What's the weather in Oslo, in celsius?", "max_tokens": 48})
            pieces: list[str] = []
            reply = await s.result(on_token=pieces.append)
            assert reply.reason == "program"
            out = reply.outputs
            jsonschema.validate({"name": out["name"], "arguments": out["arguments"]}, call_schema(DEFAULT_TOOLS))
            assert "".join(pieces) == out["call"]  # the call's tokens were streamed
            msg = reply.messages[0]
            assert msg.prompt_tokens > 0 and 0 < msg.completion_tokens <= 48

            # a ReAct loop with the program's default tools; one step is always finish
            s = await client.session(program="react",
                                     args={"question": "What is 6 * 7?", "max_steps": 1, "thought_tokens": 8})
            reply = await s.result()
            out = reply.outputs
            assert out["steps"] == 1 and out["actions"][0]["tool"] == FINISH
            jsonschema.validate(out["actions"][0], action_schema(["calculator", "search"]))
            assert isinstance(out["answer"], str)

            # fork and select across the server: two branches, a judge, all in one session
            s = await client.session(program="parallel_judge",
                                     args={"question": "Name a fruit.", "n": 2, "max_tokens": 6})
            reply = await s.result()
            out = reply.outputs
            assert len(out["candidate"]) == 2 and out["best"] in ("1", "2")
            assert out["answer"] == out["candidate"][int(out["best"]) - 1]
            assert reply.messages[0].cached_tokens > 0
        finally:
            await client.close()
        await wait_engine_idle(engine)
