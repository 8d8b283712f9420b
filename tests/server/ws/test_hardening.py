"""Issue 15, WebSocket side: deep frames and out-of-range fields get typed errors, unexpected
errors carry no exception text, Origin checks on the upgrade, the open (header) timeout and the
connection cap, and cancel / close / disconnect during a ``fork`` program aborting its whole
request tree (the KV pool back to its start). Real server, real engine, default model."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from sgrt.server import WsLimits
from sgrt.server.ws import protocol as p
from tests.server.conftest import PROGRAMS_DIR, recv, recv_until, running_server, wait_engine_idle


def start(session: str, **fields) -> str:
    return json.dumps({"type": "session.start", "session": session, **fields})


# ---- typed errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [100, 1_000, 100_000])
async def test_deep_frames_get_a_typed_error_and_the_connection_survives(ws_engine, depth):
    async with running_server(ws_engine) as server:
        async with connect(server.url, max_size=None) as ws:
            nested = "[" * depth + "]" * depth
            await ws.send(f'{{"type": "session.start", "session": "s", "args": {{"a": {nested}}}}}')
            err = await recv(ws)
            assert isinstance(err, p.Error) and err.code == "limit.json_depth", err
            assert str(depth + 2) in err.message and "max_json_depth" in err.message
            await ws.send(start("ok", sampling={"max_tokens": 1}))
            assert isinstance(await recv(ws), p.Ready)


@pytest.mark.parametrize("sampling, field", [
    ({"seed": 2**64}, "sampling.seed"),
    ({"seed": -(2**63) - 1}, "sampling.seed"),
    ({"top_k": 2**40}, "sampling.top_k"),
])
async def test_out_of_range_fields_are_invalid_request(ws_engine, sampling, field):
    async with running_server(ws_engine) as server:
        async with connect(server.url) as ws:
            await ws.send(start("s", sampling=sampling))
            err = await recv(ws)
            assert isinstance(err, p.Error) and err.code == "invalid_request" and err.field == field, err
            await ws.send(start("s2"))  # nothing else changed
            assert isinstance(await recv(ws), p.Ready)
            await ws.send(json.dumps({"type": "user", "session": "s2", "content": "Hi",
                                      "sampling": {"seed": 2**64, "max_tokens": 1}}))
            err = await recv(ws)
            assert isinstance(err, p.Error) and err.field == "sampling.seed", err


async def test_tool_parameters_with_no_finite_instance_are_refused_at_start(ws_engine):
    no_finite = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                 "required": ["next"]}}, "$ref": "#/$defs/n"}
    async with running_server(ws_engine) as server:
        async with connect(server.url) as ws:
            await ws.send(start("s", tools=[{"name": "f", "parameters": no_finite}]))
            err = await recv(ws)
            assert isinstance(err, p.Error) and err.code == "grammar" and err.field == "tools[0].parameters", err
            assert err.message.startswith("tool 'f': ") and "no finite instance" in err.message


async def test_unexpected_errors_carry_no_exception_text(ws_engine, monkeypatch):
    from sgrt.server.ws import chat_session as session_mod

    def broken(self, *args):
        raise RuntimeError("secret detail /home/user/x")

    monkeypatch.setattr(session_mod.ChatSession, "_prepare", broken)
    async with running_server(ws_engine) as server:
        async with connect(server.url) as ws:
            await ws.send(start("s", sampling={"max_tokens": 1}))
            await recv(ws)
            await ws.send(json.dumps({"type": "user", "session": "s", "content": "Hi"}))
            msgs = await recv_until(ws, p.Done)
    errors = [m for m in msgs if isinstance(m, p.Error)]
    assert errors and errors[0].code == "internal"
    assert "secret" not in errors[0].message and "RuntimeError" not in errors[0].message
    assert "incident" in errors[0].message and msgs[-1].reason == "error"


# ---- Origin, open timeout, connection cap ---------------------------------------------------------

@pytest.mark.parametrize("origin, allowed", [
    (None, True), ("http://localhost:3000", True), ("http://127.0.0.1", True),
    ("https://evil.example", False), ("null", False), ("https://app.example", True),
])
async def test_upgrade_origin_policy(ws_engine, origin, allowed):
    limits = WsLimits(allowed_origins=("https://app.example",))
    async with running_server(ws_engine, limits=limits) as server:
        if allowed:
            async with connect(server.url, origin=origin) as ws:
                await ws.send(start("s"))
                assert isinstance(await recv(ws), p.Ready)
        else:
            with pytest.raises(InvalidStatus) as info:
                async with connect(server.url, origin=origin):
                    pass
            assert info.value.response.status_code == 403


async def test_half_open_connections_are_closed_and_connections_capped(ws_engine):
    # NOTE: 1 s to finish an opening handshake: enough for a loaded machine, short for the test.
    limits = WsLimits(open_timeout_s=1.0, max_connections=2)
    async with running_server(ws_engine, limits=limits) as server:
        host, port = "127.0.0.1", server.port
        reader, writer = await asyncio.open_connection(host, port)  # never sends the upgrade
        assert await asyncio.wait_for(reader.read(), 30) == b""  # EOF: the server closed it
        writer.close()
        async with connect(server.url) as a, connect(server.url) as b:
            for ws in (a, b):  # admitted: their first message came
                await ws.send(start("s"))
                assert isinstance(await recv(ws), p.Ready)
            with pytest.raises(InvalidStatus) as info:
                async with connect(server.url):
                    pass
            assert info.value.response.status_code == 503


# ---- a program's whole request tree is aborted -----------------------------------------------------

async def _judge_in_flight(ws_engine, ws, n: int) -> None:
    """Start parallel_judge with long candidates and wait until its n branches run."""
    await ws.send(start("j", program="parallel_judge",
                        args={"question": "Tell me a long story about the sea.", "n": n, "max_tokens": 600,
                              "temperature": 0.8}))
    assert isinstance(await recv(ws), p.Ready)
    for _ in range(6000):
        if ws_engine.stats()["running"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the branches never ran: {ws_engine.stats()}")


@pytest.mark.parametrize("how", ["cancel", "close", "disconnect"])
async def test_abort_during_fork_aborts_every_branch(ws_engine, how):
    n = 3
    limits = WsLimits(max_tokens_per_turn=1024)
    async with running_server(ws_engine, programs_dir=PROGRAMS_DIR, limits=limits) as server:
        await wait_engine_idle(ws_engine)
        ws_engine.flush_cache()
        before = ws_engine.stats()
        assert before["pool_free"] == before["pool_total"]
        ws = await connect(server.url)
        await _judge_in_flight(ws_engine, ws, n)
        if how == "disconnect":
            await ws.close()
        else:
            await ws.send(json.dumps({"type": how, "session": "j"}))
            msgs = await recv_until(ws, p.Done)
            assert msgs[-1].reason == ("cancelled" if how == "cancel" else "closed"), msgs
            if how == "cancel":  # done comes once the program's threads returned: no branch left
                assert ws_engine.stats()["running"] == 0, ws_engine.stats()
            await ws.close()
        after = (await asyncio.to_thread(_idle_stats, ws_engine))
    assert after["aborted"] - before["aborted"] >= n, (before["aborted"], after["aborted"])
    # every aborted branch stopped long before its 600 tokens
    assert after["generated_tokens"] - before["generated_tokens"] < n * 600
    ws_engine.flush_cache()
    assert ws_engine.stats()["pool_free"] == before["pool_total"]


def _idle_stats(engine) -> dict:
    import time

    while engine.stats()["running"] or engine.stats()["waiting"]:
        time.sleep(0.01)
    return engine.stats()
