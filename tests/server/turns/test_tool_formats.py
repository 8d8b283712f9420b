"""Unit tests of the tool-call formats, the schema embedding and the turn parser (no model
weights: the grammars compile against the default model's tokenizer)."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from sgrt.server.turns import formats as tf
from sgrt.server.openai.adapter import think_mode
from sgrt.server.ws.protocol import ToolSpec
from sgrt.server.turns.schema_embed import embed_schema, rewrite_ref


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Address
    friends: list["Person"] = []


WEATHER = ToolSpec(name="get_weather", description="", parameters={
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]})
SAVE = ToolSpec(name="save_person", description="", parameters=Person.model_json_schema())


def test_rewrite_ref_targets():
    renamed = {("$defs", "A/b"): "args_A/b", ("definitions", "X"): "args_X"}
    assert rewrite_ref("#/$defs/A~1b", "/properties/arguments", renamed) == "#/$defs/args_A~1b"
    assert rewrite_ref("#/definitions/X/properties/y", "/p", renamed) == "#/$defs/args_X/properties/y"
    assert rewrite_ref("#", "/properties/arguments", renamed) == "#/properties/arguments"
    assert rewrite_ref("#/properties/a", "/properties/arguments", renamed) == "#/properties/arguments/properties/a"
    assert rewrite_ref("#anchor", "/p", renamed) == "#anchor"
    assert rewrite_ref("https://x/y.json", "/p", renamed) == "https://x/y.json"


def test_embed_schema_hoists_defs_and_keeps_data():
    schema = Person.model_json_schema()  # recursive: the root itself is {"$ref": "#/$defs/Person"}
    schema["$defs"]["Person"]["properties"]["name"]["default"] = {"$ref": "#/$defs/NotARef"}
    defs: dict = {"args_Address": {"type": "null"}}  # a clash gets a numbered name
    out = embed_schema(schema, "/properties/arguments", defs, "args_")
    assert out == {"$ref": "#/$defs/args_Person"} and "args_Address_2" in defs
    person = defs["args_Person"]
    assert person["properties"]["home"]["$ref"] == "#/$defs/args_Address_2"
    assert person["properties"]["friends"]["items"]["$ref"] == "#/$defs/args_Person"
    assert person["properties"]["name"]["default"] == {"$ref": "#/$defs/NotARef"}  # data, not a reference
    assert schema["$defs"]["Person"]["properties"]["home"]["$ref"] == "#/$defs/Address"  # input unchanged


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from sgrt.constrained import GrammarCompiler

    return GrammarCompiler(tokenizer, len(tokenizer))


def accepts(compiler, tokenizer, grammar: str, text: str) -> bool:
    g = compiler.compile_spec("grammar", grammar).new_grammar()
    return all(g.accept_token(t) for t in tokenizer.encode(text)) and g.is_accepting()


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NESTED = json.dumps({"name": "save_person", "arguments": {
    "name": "Ann", "home": {"street": "Main", "city": "Oslo"}, "friends": []}})


def test_generic_grammar_parallel_and_single(compiler, tokenizer):
    par = tf.turn_grammar([WEATHER, SAVE], mode="auto", parallel=True)
    one = tf.turn_grammar([WEATHER, SAVE], mode="auto", parallel=False)
    req = tf.turn_grammar([WEATHER, SAVE], mode="required", parallel=True)
    two = CALL + "\n" + NESTED
    assert accepts(compiler, tokenizer, par, two) and accepts(compiler, tokenizer, par, NESTED)
    assert accepts(compiler, tokenizer, par, "Plain text.")
    assert not accepts(compiler, tokenizer, one, two) and accepts(compiler, tokenizer, one, CALL)
    assert not accepts(compiler, tokenizer, req, "Plain text.") and accepts(compiler, tokenizer, req, two)
    bad = NESTED.replace('"city": "Oslo"', '"town": "Oslo"')
    assert not accepts(compiler, tokenizer, par, bad)


def test_hermes_grammar_text_then_calls(compiler, tokenizer):
    g = tf.turn_grammar([WEATHER], mode="auto", parallel=True, fmt=tf.HERMES)
    call = f"<tool_call>\n{CALL}\n</tool_call>"
    assert accepts(compiler, tokenizer, g, "Let me check. " + call)
    assert accepts(compiler, tokenizer, g, call + "\n" + call)
    assert accepts(compiler, tokenizer, g, "No tools needed.")
    assert not accepts(compiler, tokenizer, g, "x <tool_call>\n{\"name\": \"other\"}")
    single = tf.turn_grammar([WEATHER], mode="required", parallel=False, fmt=tf.HERMES)
    assert accepts(compiler, tokenizer, single, call) and not accepts(compiler, tokenizer, single, call + "\n" + call)


def test_think_then_json_answer(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    g = tf.turn_grammar([], mode="none", think="open", answer_schema=schema)
    assert accepts(compiler, tokenizer, g, '<think>free { text</think>\n{"a": 1}') or \
        accepts(compiler, tokenizer, g, '<think>free { text</think>\n{"a":1}')
    assert not accepts(compiler, tokenizer, g, '<think>x</think>not json')
    inside = tf.turn_grammar([WEATHER], mode="required", think="inside")
    assert accepts(compiler, tokenizer, inside, "hmm</think>\n\n" + CALL)


def test_detect_traits_from_templates():
    qwen = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{{ tc }}\n</tool_call>" \
           "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    traits = tf.detect_traits(qwen)
    assert traits.tool_format is tf.HERMES and traits.thinking and traits.thinking_switch == "enable_thinking"
    assert tf.detect_traits("{{ '[TOOL_CALLS]' }}{{ tools }}").tool_format is tf.MISTRAL
    llama = "<|start_header_id|>ipython<|end_header_id|>{{ tools }} {\"name\": ..., \"parameters\": ...}"
    assert tf.detect_traits(llama).tool_format is tf.LLAMA3
    smol = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    assert tf.detect_traits(smol) == tf.TemplateTraits() and tf.detect_traits(None).tool_format is tf.GENERIC
    assert think_mode("<|im_start|>assistant\n<think>\n") == "inside"
    assert think_mode("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert think_mode("<|im_start|>assistant\n") == "open"


@pytest.mark.parametrize("fmt,text", [
    (tf.GENERIC, CALL + "\n" + CALL.replace("Paris", "Rome")),
    (tf.HERMES, f"Sure.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL.replace('Paris', 'Rome')}\n</tool_call>"),
    (tf.LLAMA3, CALL.replace("arguments", "parameters") + "; " + CALL.replace("arguments", "parameters")
     .replace("Paris", "Rome")),
    (tf.MISTRAL, "[TOOL_CALLS][" + CALL + ", " + CALL.replace("Paris", "Rome") + "]"),
])
def test_parse_and_stream_every_format(fmt, text):
    final = tf.parse_turn(text, fmt, final=True)
    calls = tf.finished_calls(final, [WEATHER])
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert final.content.strip() == ("Sure." if fmt is tf.HERMES else "")
    # Streamed a few characters at a time: name first, then the arguments in several fragments
    # that add up to the final text.
    s = tf.TurnStreamer(fmt)
    events = []
    for k in range(0, len(text), 3):
        events += s.feed(text[k:k + 3])
    events += s.feed("", final=True)
    names = [e for e in events if e.kind == "call"]
    assert [e.name for e in names] == ["get_weather", "get_weather"]
    frags = [e for e in events if e.kind == "args" and e.index == 0]
    assert len(frags) > 2 and "".join(e.text for e in frags) == calls[0].arguments
    first_call = events.index(names[0])
    assert all(e.kind != "args" or e.index == 1 for e in events[:first_call]) is True
    assert "".join(e.text for e in events if e.kind == "text").strip() == final.content.strip()


def test_stream_reasoning_and_held_trigger():
    s = tf.TurnStreamer(tf.HERMES, think="open")
    out = []
    for piece in ["<thi", "nk>plan", " it</th", "ink>\n\nHello <tool", "_call>\n", CALL, "\n</tool_call>"]:
        out += s.feed(piece)
    reasoning = "".join(e.text for e in out if e.kind == "reasoning")
    text = "".join(e.text for e in out if e.kind == "text")
    assert reasoning == "plan it" and text == "Hello " and [e.name for e in out if e.kind == "call"] == ["get_weather"]
    plain = tf.TurnStreamer(tf.HERMES)
    assert [e.text for e in plain.feed("a <tool")] == ["a "]  # "<tool" may start the trigger
    assert [e.text for e in plain.feed("box> b", final=True)] == ["<toolbox> b"]


def test_ws_session_tools_embed_defs(compiler, tokenizer):
    """The WebSocket sessions' tool grammar embeds the parameters the same way."""
    from sgrt.server.turns.tools import tool_grammar, validate_tool_grammar

    validate_tool_grammar([SAVE])  # raised "Pointer '/$defs/Address' does not exist" before
    g = tool_grammar([SAVE], "required")
    assert accepts(compiler, tokenizer, g, NESTED)
    assert not accepts(compiler, tokenizer, g, NESTED.replace('"city": "Oslo"', '"city": 3'))


# A Qwen-3-style chat template, written here (not the model's): tools rendered in the system
# turn, assistant tool_calls as <tool_call> blocks, and the enable_thinking switch.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "\nCall with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


class TemplateTokenizer:
    """Just what ChatRenderer reads: ``hf.chat_template`` and ``apply_chat_template``."""

    def __init__(self, template: str):
        import jinja2

        self.hf = type("HF", (), {"chat_template": template})()
        self._t = jinja2.Environment().from_string(template)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kw):
        return self._t.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **kw)


def test_renderer_native_format_and_thinking_switch():
    from sgrt.server.openai import protocol as op
    from sgrt.server.openai.adapter import ChatRenderer, plan_tools

    renderer = ChatRenderer(TemplateTokenizer(QWEN_LIKE))
    assert renderer.traits.tool_format is tf.HERMES and renderer.traits.thinking_switch == "enable_thinking"
    assert renderer.renders_tools()
    tools = [op.ToolDef(function=op.FunctionDef(name="get_weather", parameters=WEATHER.parameters))]
    msgs = [op.ChatMessage(role="user", content="Weather in Oslo?"),
            op.ChatMessage(role="assistant", tool_calls=[op.ToolCall(id="c1", function=op.ToolCallFunction(
                name="get_weather", arguments='{"city": "Oslo"}'))]),
            op.ChatMessage(role="tool", tool_call_id="c1", content="sunny")]
    req = op.ChatCompletionRequest(messages=msgs, tools=tools, tool_choice="required")
    plan = plan_tools(req, 8, renderer.traits.tool_format)
    off = renderer.render(msgs, plan, reasoning_effort="none")
    assert plan.thinking_enabled is False and plan.think is None and off.endswith("<think>\n\n</think>\n\n")
    # The history's call is rendered by the template itself, in its format.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in off
    assert "Tools: get_weather" in off
    on = renderer.render(msgs, plan, reasoning_effort="high")
    assert plan.thinking_enabled is True and plan.think == "open" and on.endswith("<|im_start|>assistant\n")
    fields: dict = {}
    plan.finish(fields)
    assert "think[lazy]" in fields["grammar"] and "<tool_call>" in fields["grammar"]
    assert fields["skip_special_tokens"] is False



def test_mistral_trigger_token_named_by_id(tokenizer):
    """A trigger that is one special token is named by id in the grammar (here SmolLM2's
    <|im_start|> stands in for Mistral's [TOOL_CALLS] control token)."""
    from sgrt.server.openai.adapter import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    tid = renderer.special_token_id("<|im_start|>")
    assert tid == tokenizer.encode("<|im_start|>")[0] and renderer.special_token_id("hello") is None
    g = tf.turn_grammar([WEATHER], mode="required", fmt=tf.MISTRAL, trigger_token=7)
    assert g.splitlines()[-2].startswith("calls: <[7]> ") and '"[TOOL_CALLS]"' not in g
