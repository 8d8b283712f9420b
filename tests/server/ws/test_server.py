"""The session server end to end: real server on a loopback port, real engine on the default
model (small max_tokens), the sgrt.client on the other side."""
from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from sgrt.client import AgentSession, Client, ServerError
from sgrt.server import WsLimits
from sgrt.server.ws import protocol as p
from tests.server.conftest import PROGRAMS_DIR, recv, recv_until, running_server, wait_engine_idle


async def test_chat_streams_and_cached_tokens_grow_turn_by_turn(ws_engine):
    async with running_server(ws_engine) as server:
        async with await AgentSession.connect(server.url, sampling={"max_tokens": 8}) as s:
            assert s.ready.limits["max_tokens_per_turn"] == WsLimits().max_tokens_per_turn
            cached, prompts = [], []
            for q in ["Hi! What is your name?", "What is 2 + 2?", "Name a colour.", "Thanks, bye."]:
                pieces: list[str] = []
                reply = await s.send(q, on_token=pieces.append)
                assert reply.reason == "turn" and len(reply.messages) == 1
                msg = reply.messages[0]
                assert "".join(pieces) == msg.content == reply.text
                assert msg.finish_reason in ("stop", "length") and 0 < msg.completion_tokens <= 8
                assert msg.ttft is not None and msg.ttft > 0 and reply.client_ttft is not None
                cached.append(msg.cached_tokens)
                prompts.append(msg.prompt_tokens)
    # turn N reuses everything before its new messages: the previous prompt and the previous
    # reply (all but its last token, whose KV was never computed)
    assert cached[0] < cached[1] < cached[2] < cached[3], cached
    for n in range(1, 4):
        assert cached[n] >= prompts[n - 1], (cached, prompts)
        assert prompts[n] - cached[n] < 40, (cached, prompts)  # only the new tokens prefill


async def test_bad_frames_get_errors_naming_the_field_and_the_connection_survives(ws_engine):
    async with running_server(ws_engine) as server:
        async with connect(server.url) as ws:
            cases = [
                ("{not json", "bad_json", None),
                ('{"type": "shout", "session": "a"}', "unknown_type", "type"),
                ('{"type": "user", "session": "a", "content": 42}', "bad_message", "content"),
                ('{"type": "user", "session": "nope", "content": "hi"}', "unknown_session", "session"),
                ('{"type": "session.start", "session": "a", "sampling": {"temperature": "hot"}}',
                 "bad_message", "sampling.temperature"),
                ('{"type": "session.start", "session": "a", "sampling": {"top_p": 7}}', "invalid_request",
                 "sampling.top_p"),
                ('{"type": "session.start", "session": "a", "program": "no_such_program"}', "unknown_program",
                 "program"),
                ('{"type": "session.start", "session": "a", "args": {"x": 1}}', "invalid_request", "args"),
                ('{"type": "session.start", "session": "a", "tools": [{"name": "t", "parameters": '
                 '{"type": "object", "properties": {"x": {"type": "strin"}}}}]}', "grammar", "tools[0].parameters"),
            ]
            for raw, code, field in cases:
                await ws.send(raw)
                err = await recv(ws)
                assert isinstance(err, p.Error), raw
                assert (err.code, err.field) == (code, field), (raw, err)
            await ws.send(b"\x00\x01binary junk")
            assert (await recv(ws)).code == "bad_json"
            # the same connection still serves a session normally
            await ws.send(json.dumps({"type": "session.start", "session": "a", "sampling": {"max_tokens": 4}}))
            assert isinstance(await recv(ws), p.Ready)
            await ws.send(json.dumps({"type": "session.start", "session": "a"}))
            assert (await recv(ws)).code == "session_exists"
            await ws.send(json.dumps({"type": "tool_result", "session": "a", "call_id": "x", "content": "1"}))
            err = await recv(ws)
            assert (err.code, err.field, err.session) == ("unknown_call", "call_id", "a")
            await ws.send(json.dumps({"type": "user", "session": "a", "content": "Say hi."}))
            msgs = await recv_until(ws, p.Done)
            assert isinstance(msgs[-2], p.Message) and msgs[-1].reason == "turn"


async def test_limits_get_typed_errors_and_other_sessions_stay_healthy(ws_engine):
    limits = WsLimits(max_message_bytes=2048, max_sessions=3, max_sessions_per_connection=2,
                      max_tokens_per_turn=16, max_tools=1)
    async with running_server(ws_engine, limits=limits) as server:
        bystander = await AgentSession.connect(server.url, sampling={"max_tokens": 6})
        async with connect(server.url) as ws:
            await ws.send("x" * 3000)
            assert (await recv(ws)).code == "limit.message_size"
            await ws.send(json.dumps({"type": "session.start", "session": "a", "sampling": {"max_tokens": 17}}))
            err = await recv(ws)
            assert (err.code, err.field) == ("limit.max_tokens", "sampling.max_tokens")
            tool = {"name": "t", "parameters": {"type": "object"}}
            await ws.send(json.dumps({"type": "session.start", "session": "a", "tools": [tool, dict(tool, name="u")]}))
            err = await recv(ws)
            assert (err.code, err.field) == ("limit.tools", "tools")
            for sid in ("a", "b"):
                await ws.send(json.dumps({"type": "session.start", "session": sid, "sampling": {"max_tokens": 6}}))
                assert isinstance(await recv(ws), p.Ready)
            await ws.send(json.dumps({"type": "session.start", "session": "c"}))
            err = await recv(ws)
            assert (err.code, err.field) == ("limit.sessions", "session")  # per connection
            async with connect(server.url) as ws2:
                await ws2.send(json.dumps({"type": "session.start", "session": "z"}))
                assert (await recv(ws2)).code == "limit.sessions"  # server-wide (3 open)
            await ws.send(json.dumps({"type": "user", "session": "a", "content": "hi", "sampling": {"max_tokens": 99}}))
            err = await recv(ws)
            assert (err.code, err.field, err.session) == ("limit.max_tokens", "sampling.max_tokens", "a")
            # one generation at a time per chat session: a second user message is refused
            await ws.send(json.dumps({"type": "user", "session": "a", "content": "Count to ten."}))
            await ws.send(json.dumps({"type": "user", "session": "a", "content": "again"}))
            msgs = await recv_until(ws, p.Done)
            errors = [m for m in msgs if isinstance(m, p.Error)]
            assert [(e.code, e.session) for e in errors] == [("limit.generations", "a")]
            # the other session on this connection and the bystander still work
            await ws.send(json.dumps({"type": "user", "session": "b", "content": "Say hi."}))
            assert (await recv_until(ws, p.Done))[-1].reason == "turn"
        reply = await bystander.send("Hello!")
        assert reply.reason == "turn" and reply.text
        await bystander.close()
        assert server.num_sessions == 0


async def test_auth_token_is_required_in_the_first_message(ws_engine):
    async with running_server(ws_engine, auth_token="s3cret") as server:
        async with connect(server.url) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "a", "auth_token": "wrong"}))
            err = await recv(ws)
            assert (err.code, err.field) == ("unauthorized", "auth_token")
            with pytest.raises(ConnectionClosed):
                await recv(ws)
            assert ws.close_code == 1008
        with pytest.raises(ServerError) as info:
            await AgentSession.connect(server.url)
        assert info.value.code == "unauthorized"
        async with await AgentSession.connect(server.url, auth_token="s3cret", sampling={"max_tokens": 4}) as s:
            assert (await s.send("hi")).reason == "turn"


async def _start_long_turn(ws, sid: str) -> None:
    await ws.send(json.dumps({"type": "session.start", "session": sid,
                              "sampling": {"max_tokens": 400, "ignore_eos": True}}))
    assert isinstance(await recv(ws), p.Ready)
    await ws.send(json.dumps({"type": "user", "session": sid, "content": "Tell me a very long story."}))
    first = await recv(ws)
    assert isinstance(first, p.Token), first  # it is generating


async def test_disconnect_mid_stream_aborts_and_frees_kv(ws_engine):
    await wait_engine_idle(ws_engine)
    ws_engine.flush_cache()
    start = ws_engine.pool.num_free
    async with running_server(ws_engine) as server:
        ws = await connect(server.url)
        await _start_long_turn(ws, "a")
        await ws.close()  # walk away mid-stream
        await wait_engine_idle(ws_engine)
        assert server.num_sessions == 0
    stats = ws_engine.stats()
    ws_engine.flush_cache()
    assert ws_engine.pool.num_free == start
    assert stats["running"] == 0
    ws_engine.check_integrity()


async def test_cancel_mid_stream_aborts_and_frees_kv(ws_engine):
    await wait_engine_idle(ws_engine)
    ws_engine.flush_cache()
    start = ws_engine.pool.num_free
    async with running_server(ws_engine) as server:
        async with connect(server.url) as ws:
            await _start_long_turn(ws, "a")
            await ws.send(json.dumps({"type": "cancel", "session": "a"}))
            msgs = await recv_until(ws, p.Done)
            msg = next(m for m in msgs if isinstance(m, p.Message))
            assert msg.finish_reason == "abort" and msg.completion_tokens < 400
            assert msgs[-1].reason == "cancelled"
            await wait_engine_idle(ws_engine)
            ws_engine.flush_cache()
            assert ws_engine.pool.num_free == start
            # the session goes on after a cancel
            await ws.send(json.dumps({"type": "user", "session": "a", "content": "Short answer: hi?",
                                      "sampling": {"max_tokens": 4, "ignore_eos": False}}))
            assert (await recv_until(ws, p.Done))[-1].reason == "turn"
            await ws.send(json.dumps({"type": "cancel", "session": "a"}))  # nothing running
            assert (await recv(ws)).reason == "cancelled"


async def test_idle_sessions_never_block_new_ones(loaded_model):
    """A small KV pool, more idle sessions than it can cache: new sessions are still served
    (idle conversations are evicted LRU) and an evicted session's next turn recomputes."""
    from sgrt.engine import Engine

    engine = Engine(model=loaded_model, max_total_tokens=512)
    try:
        async with running_server(engine) as server:
            client = await Client.connect(server.url)
            sessions = []
            for i in range(10):  # ~60 tokens each: 600 > 512
                s = await client.session(sampling={"max_tokens": 8, "ignore_eos": True},
                                         system=f"You are assistant number {i}.")
                reply = await s.send(f"Session {i}: say something.")
                assert reply.reason == "turn" and reply.messages[0].completion_tokens == 8
                sessions.append(s)
            await wait_engine_idle(engine)
            assert engine.stats()["cache_tokens"] <= 512
            fresh = await client.session(sampling={"max_tokens": 8})
            assert (await fresh.send("A new session: hello!")).reason == "turn"
            again = await sessions[0].send("Back to the first session.")
            assert again.reason == "turn" and again.text
            await client.close()
        await wait_engine_idle(engine)
        engine.check_integrity()
    finally:
        engine.shutdown()


async def test_idle_timeout_closes_the_session(ws_engine):
    # NOTE: after the session's done, the test has idle_timeout_s to send its next message before
    # the idle connection is closed: 1 s leaves room on a loaded machine.
    async with running_server(ws_engine, limits=WsLimits(idle_timeout_s=1.0)) as server:
        async with connect(server.url) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "a"}))
            assert isinstance(await recv(ws), p.Ready)
            err = await recv(ws, timeout=60)
            assert (err.code, err.session) == ("limit.idle_timeout", "a")
            done = await recv(ws, timeout=60)
            assert (done.reason, done.session) == ("idle_timeout", "a")
            assert server.num_sessions == 0
            await ws.send(json.dumps({"type": "user", "session": "a", "content": "hi"}))
            assert (await recv(ws)).code == "unknown_session"
            # a connection without sessions is closed once idle for as long
            with pytest.raises(ConnectionClosed):
                await recv(ws, timeout=60)
            assert ws.close_code == 1000


async def test_registered_program_runs_and_streams(ws_engine):
    async with running_server(ws_engine, programs_dir=PROGRAMS_DIR) as server:
        if "echo_summary" not in server.registry.names():
            pytest.skip(f"echo_summary did not load: {server.registry.errors}")
        client = await Client.connect(server.url)
        s = await client.session(program="echo_summary",
                                 args={"text": "The river flooded the town after three days of rain."})
        assert s.ready.program == "echo_summary"
        pieces: list[str] = []
        reply = await s.result(on_token=pieces.append)
        assert reply.reason == "program"
        summary = reply.outputs["summary"]
        assert summary and "".join(pieces) == summary
        msg = reply.messages[0]
        assert 0 < msg.completion_tokens <= 32 and msg.prompt_tokens > 0 and summary in msg.content
        with pytest.raises(ServerError) as info:  # refused at session.start, before the program runs
            await client.session(program="echo_summary", args={"txt": "typo"})
        assert (info.value.code, info.value.field) == ("invalid_request", "args.txt")
        await client.close()


LONG_PROGRAMS = '''
import sgrt


@sgrt.function
def story(s, topic):
    s += sgrt.user("Tell a very long story about " + topic + ".")
    s += sgrt.assistant(sgrt.gen("story", max_tokens=400, ignore_eos=True))


@sgrt.function
def greedy_gen(s):
    s += sgrt.user("hi")
    s += sgrt.assistant(sgrt.gen("x", max_tokens=5000))


@sgrt.function
def wide_fork(s):
    s += sgrt.user("Name a fruit.")
    forks = s.fork(3)
    forks += sgrt.assistant(sgrt.gen("fruit", max_tokens=32, ignore_eos=True))
    forks.join()
'''


async def test_program_cancel_frees_kv_and_program_limits(ws_engine, tmp_path):
    (tmp_path / "long_programs.py").write_text(LONG_PROGRAMS)
    await wait_engine_idle(ws_engine)
    ws_engine.flush_cache()
    start = ws_engine.pool.num_free
    limits = WsLimits(max_tokens_per_turn=512, max_generations_per_session=2)
    async with running_server(ws_engine, programs_dir=tmp_path, limits=limits) as server:
        assert server.registry.names() == ["greedy_gen", "story", "wide_fork"], server.registry.errors
        async with connect(server.url) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": "p", "program": "story",
                                      "args": {"topic": "a lighthouse"}}))
            assert isinstance(await recv(ws), p.Ready)
            assert isinstance(await recv(ws), p.Token)
            await ws.send(json.dumps({"type": "cancel", "session": "p"}))
            msgs = await recv_until(ws, p.Done)
            assert msgs[-1].reason == "cancelled"
            msg = next(m for m in msgs if isinstance(m, p.Message))
            assert msg.finish_reason == "abort"
            for program, code in [("greedy_gen", "limit.max_tokens"), ("wide_fork", "limit.generations")]:
                await ws.send(json.dumps({"type": "session.start", "session": program, "program": program}))
                msgs = await recv_until(ws, p.Done)
                errors = [m for m in msgs if isinstance(m, p.Error)]
                assert [e.code for e in errors] == [code], msgs
                assert msgs[-1].reason == "error"
        await wait_engine_idle(ws_engine)
    ws_engine.flush_cache()
    assert ws_engine.pool.num_free == start
