"""The wire protocol, tool grammars and the program registry (no model weights needed)."""
from __future__ import annotations

import json

import pytest

from sgrt.errors import InvalidRequest
from sgrt.server.ws import protocol as p
from sgrt.server.ws.programs import ProgramRegistry
from sgrt.server.turns.tools import check_tools, parse_tool_call, tool_grammar, tools_system_prompt
from tests.server.conftest import PROGRAMS_DIR

CALC = p.ToolSpec(name="calculator", description="arithmetic", parameters={
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
SEARCH = p.ToolSpec(name="search", description="notes", parameters={
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query"]})


@pytest.mark.parametrize("raw, code, field", [
    ('{"type": "user", "session": "s", "content": "hi"', "bad_json", None),
    (b"\xff\xfe", "bad_json", None),
    ("[1, 2]", "bad_message", None),
    ('{"type": "dance", "session": "s"}', "unknown_type", "type"),
    ('{"session": "s", "content": "hi"}', "bad_message", "type"),
    ('{"type": "user", "session": "s", "content": 3}', "bad_message", "content"),
    ('{"type": "user", "session": "s"}', "bad_message", "content"),
    ('{"type": "user", "session": 5, "content": "x"}', "bad_message", "session"),
    ('{"type": "user", "session": "", "content": "x"}', "bad_message", "session"),
    ('{"type": "user", "session": "s", "content": "x", "colour": 1}', "bad_message", "colour"),
    ('{"type": "user", "session": "s", "content": "x", "v": 2}', "unsupported_version", "v"),
    ('{"type": "session.start", "session": "s", "sampling": {"max_tokens": "ten"}}', "bad_message",
     "sampling.max_tokens"),
    ('{"type": "session.start", "session": "s", "sampling": {"temprature": 1}}', "bad_message",
     "sampling.temprature"),
    ('{"type": "session.start", "session": "s", "tools": [{"description": "x"}]}', "bad_message",
     "tools[0].name"),
    ('{"type": "session.start", "session": "s", "tools": [{"name": "t", "parameters": []}]}', "bad_message",
     "tools[0].parameters"),
    ('{"type": "tool_result", "session": "s", "call_id": "c", "content": {"a": 1}}', "bad_message", "content"),
])
def test_bad_client_messages_name_the_field(raw, code, field):
    with pytest.raises(p.ProtocolError) as info:
        p.decode_client(raw)
    assert info.value.code == code
    assert info.value.field == field
    assert info.value.code in p.ERROR_CODES
    err = p.decode_server(p.encode(info.value.to_message()))
    assert isinstance(err, p.Error) and err.code == code and err.field == field


def test_errors_keep_the_session_id_when_they_can():
    with pytest.raises(p.ProtocolError) as info:
        p.decode_client('{"type": "user", "session": "abc", "content": 3}')
    assert info.value.session == "abc"


def test_client_messages_decode_with_defaults():
    msg = p.decode_client(json.dumps({"type": "session.start", "session": "s1", "tools": [
        {"name": "calculator", "parameters": CALC.parameters}], "sampling": {"max_tokens": 8, "temperature": 0}}))
    assert isinstance(msg, p.SessionStart) and msg.v == p.PROTOCOL_VERSION
    assert msg.tools[0].description == "" and msg.program is None and msg.args == {}
    assert msg.sampling.fields_set() == {"max_tokens": 8, "temperature": 0.0}
    assert isinstance(p.decode_client('{"type": "cancel", "session": "s1", "v": 1}'), p.Cancel)


def test_server_messages_round_trip():
    msgs = [
        p.Ready(session="s", tools=["calculator"], limits={"max_sessions": 2}),
        p.Token(session="s", turn=1, text="Hel"),
        p.ToolCall(session="s", turn=1, call_id="call-1", name="calculator", arguments={"expression": "1+1"}),
        p.Message(session="s", turn=1, content="hi", finish_reason="stop", ttft=0.01, prompt_tokens=9,
                  completion_tokens=2, cached_tokens=4,
                  tool_call=p.ToolCallInfo(call_id="c", name="n", arguments={})),
        p.Error(code="limit.sessions", message="too many", field="session"),
        p.Done(session="s", turn=2, reason="turn"),
    ]
    for msg in msgs:
        wire = json.loads(p.encode(msg))
        assert wire["v"] == p.PROTOCOL_VERSION and "type" in wire
        assert p.decode_server(p.encode(msg)) == msg


def test_check_tools_refuses_bad_specs():
    for tools, field in [
        ([p.ToolSpec(name="bad name")], "tools[0].name"),
        ([CALC, CALC], "tools[1].name"),
        ([p.ToolSpec(name="t", parameters={"type": "string"})], "tools[0].parameters"),
        ([CALC, SEARCH], "tools"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            check_tools(tools, max_tools=1 if len(tools) == 2 and tools[1] is SEARCH else 8)
        assert info.value.field == field
    check_tools([CALC, SEARCH], max_tools=2)


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    from llguidance.hf import from_tokenizer

    return from_tokenizer(tokenizer.hf)


def test_tool_grammar_allows_text_or_exactly_one_valid_call(tokenizer, ll_tokenizer):
    import llguidance

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("lark", grammar))
        return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()

    g = tool_grammar([CALC, SEARCH])
    assert g.count("%json") == 2
    ok = [
        "The answer is 4.",
        "Sure!\n{not a call}",
        '{"name": "calculator", "arguments": {"expression": "17 * 23"}}',
        '{"name": "search", "arguments": {"query": "Eiffel", "limit": 2}}',
    ]
    bad = [
        '{"name": "calculator", "arguments": {"query": "x"}}',  # wrong tool's arguments
        '{"name": "weather", "arguments": {}}',  # unknown tool
        '{"name": "search", "arguments": {"query": 3}}',  # wrong type
        '{"name": "search", "arguments": {"query": "x"}} and more',  # text after the call
        '{"arguments": {"query": "x"}, "name": "search"}',  # name must come first
        "{hello}",  # free text may not start with {
    ]
    for text in ok:
        assert accepts(g, text), text
    for text in bad:
        assert not accepts(g, text), text


def test_parse_tool_call_and_prompt():
    assert parse_tool_call('{"name": "calculator", "arguments": {"expression": "2"}}', [CALC]) == (
        "calculator", {"expression": "2"})
    assert parse_tool_call('{"name": "other", "arguments": {}}', [CALC]) is None
    assert parse_tool_call('{"name": "calculator", "arguments": {"expr', [CALC]) is None
    assert parse_tool_call("plain text", [CALC]) is None
    prompt = tools_system_prompt([CALC, SEARCH])
    assert "calculator" in prompt and "search" in prompt and '"arguments"' in prompt


def test_registry_discovers_programs_in_a_folder(tmp_path):
    registry = ProgramRegistry.from_dir(PROGRAMS_DIR)
    assert "echo_summary" in registry.names(), registry.errors
    (tmp_path / "good.py").write_text(
        "import sgrt\n\n@sgrt.function\ndef hello(s, name):\n    s += 'Hello ' + name\n\n"
        "@sgrt.function\ndef bye(s):\n    s += 'bye'\n\nnot_a_program = 3\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "_private.py").write_text("raise RuntimeError('never imported')\n")
    registry = ProgramRegistry.from_dir(tmp_path)
    assert registry.names() == ["bye", "hello"]
    assert list(registry.errors) == [str(tmp_path / "broken.py")] and "boom" in registry.errors[str(tmp_path / "broken.py")]
    with pytest.raises(FileNotFoundError):
        ProgramRegistry.from_dir(tmp_path / "missing")
