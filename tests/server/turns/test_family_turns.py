"""Model families' own tool-call and reasoning formats end to end: tiny checkpoints built here
(as ``tests/models/test_families.py`` builds them), each with a chat template in its family's
format, served over HTTP and driven with the official ``openai`` client.

- Mistral: a random-weight ``MistralForCausalLM`` whose tokenizer has ``[TOOL_CALLS]`` as a
  special token and a template that renders tools and calls in Mistral's form. A forced call
  (``tool_choice``) must come back as OpenAI ``tool_calls`` parsed from ``[TOOL_CALLS][...]``,
  plain and streamed.
- Qwen 3: a ``Qwen3ForCausalLM`` built as a bigram table (attention and MLP outputs zeroed, so
  the next token is a function of the current one; embeddings and LM head set so that greedy
  decoding after the generation prompt writes ``<think>\\nThe answer is yes.</think>``). Its
  template has ``<think>`` and the ``enable_thinking`` switch. Thinking must arrive as
  ``reasoning_content`` (chat) and a reasoning item (Responses), ``response_format`` must hold
  for the answer after ``</think>``, and ``reasoning_effort`` must flip the switch.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.server.conftest_http import needs_constraints
from .test_tool_formats import QWEN_LIKE

pytestmark = needs_constraints
openai = pytest.importorskip("openai")

# A Mistral-style template written for this test: tools in [AVAILABLE_TOOLS], the assistant's
# calls as [TOOL_CALLS][{...}, ...], tool results in [TOOL_RESULTS].
MISTRAL_LIKE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role in ('user', 'system') %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>"
    "{% elif m.role == 'assistant' %}{{ m.content }}<|im_end|>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}"
    "{% endfor %}")

THOUGHT = " The answer is yes."  # what the bigram Qwen 3 model thinks
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


def _tokenizer(template: str, special: list[str]):
    """The default model's tokenizer with ``special`` added and ``template`` as chat template."""
    from transformers import AutoTokenizer

    from sgrt.models.loader import DEFAULT_MODEL, tokenizer_folder

    folder = tokenizer_folder(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if special:
        tok.add_special_tokens({"additional_special_tokens": special})
    tok.chat_template = template
    return tok


def _small(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def _save(model, tok, folder) -> str:
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return str(folder)


def _bigram(model, tok, chain: list[int]) -> None:
    """Make greedy decoding follow ``chain`` (token ids): every layer's output projections are
    zeroed (the residual stream is the current token's embedding), each chain token's embedding
    is its own basis vector, and the LM head row of its successor points along it."""
    hidden = model.config.hidden_size
    slots = {t: k for k, t in enumerate(dict.fromkeys(chain[:-1]))}
    assert len(slots) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for t, k in slots.items():
            emb[t].zero_()
            emb[t, k] = 1.0
        successors: dict[int, int] = {}
        for cur, nxt in zip(chain, chain[1:]):
            assert successors.setdefault(cur, nxt) == nxt, "the chain must be a function of the current token"
        for cur, nxt in successors.items():
            head[nxt].zero_()
        for cur, nxt in successors.items():
            head[nxt, slots[cur]] += 10.0


@pytest.fixture(scope="module")
def family_servers(tmp_path_factory):
    """name -> a running HttpServerThread over the tiny checkpoint of that family."""
    import transformers as tfm

    from sgrt.engine import Engine
    from sgrt.models import load_model
    from sgrt.server.http.server import HttpServerThread

    torch.manual_seed(0)
    mtok = _tokenizer(MISTRAL_LIKE, ["[TOOL_CALLS]"])
    mistral = tfm.MistralForCausalLM(tfm.MistralConfig(**_small(len(mtok)))).float().eval()
    qtok = _tokenizer(QWEN_LIKE, [])
    qwen = tfm.Qwen3ForCausalLM(tfm.Qwen3Config(**_small(len(qtok)), head_dim=16)).float().eval()
    gen_prompt = qtok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                          add_generation_prompt=True)
    chain = qtok.encode(gen_prompt)[-1:] + qtok.encode("<think>" + THOUGHT + "</think>")
    _bigram(qwen, qtok, chain)
    folders = {"mistral": _save(mistral, mtok, tmp_path_factory.mktemp("mistral")),
               "qwen3": _save(qwen, qtok, tmp_path_factory.mktemp("qwen3"))}
    servers, engines = {}, []
    try:
        for name, folder in folders.items():
            eng = Engine(model=load_model(folder, dtype="float32"), max_total_tokens=2048)
            engines.append(eng)
            servers[name] = HttpServerThread(eng, model_name=f"tiny-{name}").start()
        yield servers
    finally:
        for s in servers.values():
            s.stop()
        for e in engines:
            e.shutdown()
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_mistral_forced_call_parsed_from_tool_calls_token(family_servers):
    server = family_servers["mistral"]
    c = _client(server)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="tiny-mistral", messages=msgs, tools=[WEATHER, TIME], temperature=0, max_tokens=40,
              parallel_tool_calls=False)
    r = c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 8
    # "required" with two tools: one call of either, in the same [TOOL_CALLS] form.
    req = c.chat.completions.create(tool_choice="required", **kw).choices[0]
    assert req.finish_reason == "tool_calls" and len(req.message.tool_calls) == 1
    assert req.message.tool_calls[0].function.name in ("get_weather", "get_time")

    # Streamed: the id and name first, then argument fragments that add up to the same call
    # (greedy, so the same text as the plain request).
    chunks = list(c.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, **kw))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    frags = [d.function.arguments for d in deltas if d.function.arguments]
    assert len(frags) >= 2 and "".join(frags) == call.function.arguments
    assert not any(ch.choices[0].delta.content for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The call goes back into the history in Mistral's own form, rendered by the template, and
    # the conversation continues.
    import msgspec

    from sgrt.server.openai import protocol as op
    from sgrt.server.openai.adapter import ChatRenderer, plan_tools

    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    body = {"model": "tiny-mistral", "messages": history, "tools": [WEATHER], "tool_choice": "none"}
    renderer = ChatRenderer(server.engine.tokenizer)
    assert renderer.traits.tool_format.name == "mistral" and renderer.renders_tools()
    req = msgspec.json.decode(json.dumps(body), type=op.ChatCompletionRequest)
    text = renderer.render(req.messages, plan_tools(req, 8, renderer.traits.tool_format))
    assert f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(args)}}}]' in text
    assert "[TOOL_RESULTS]sunny[/TOOL_RESULTS]" in text and "[AVAILABLE_TOOLS]" in text
    follow = c.chat.completions.create(max_tokens=3, temperature=0, **body)
    assert follow.choices[0].message.tool_calls is None and follow.usage.completion_tokens <= 3
    c.close()


def test_qwen3_thinking_then_json_answer(family_servers):
    c = _client(family_servers["qwen3"])
    msgs = [{"role": "user", "content": "Is it?"}]
    r = c.chat.completions.create(model="tiny-qwen3", messages=msgs, temperature=0, max_tokens=40,
                                  response_format=ANSWER_FORMAT, reasoning_effort="high")
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == THOUGHT
    assert r.choices[0].finish_reason == "stop" and set(json.loads(msg.content)) == {"ok"}, repr(msg.content)
    assert isinstance(json.loads(msg.content)["ok"], bool)
    # Streamed: reasoning deltas first, then the answer, each adding up to the same text.
    chunks = list(c.chat.completions.create(model="tiny-qwen3", messages=msgs, temperature=0, max_tokens=40,
                                            response_format=ANSWER_FORMAT, stream=True))
    reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks if ch.choices)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert reasoning == THOUGHT and content == msg.content
    # reasoning_effort "none" renders the template's enable_thinking=false (an empty closed
    # block): no reasoning, and the JSON answer straight away.
    off = c.chat.completions.create(model="tiny-qwen3", messages=msgs, temperature=0, max_tokens=40,
                                    response_format=ANSWER_FORMAT, reasoning_effort="none").choices[0].message
    assert not off.model_extra.get("reasoning_content") and set(json.loads(off.content)) == {"ok"}
    c.close()


def test_qwen3_thinking_as_responses_reasoning_item(family_servers):
    c = _client(family_servers["qwen3"])
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    r = c.responses.create(model="tiny-qwen3", input="Is it?", temperature=0, max_output_tokens=40,
                           reasoning={"effort": "medium"}, text={"format": fmt})
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT
    assert set(json.loads(r.output_text)) == {"ok"}
    events = list(c.responses.create(model="tiny-qwen3", input="Is it?", temperature=0, max_output_tokens=40,
                                     text={"format": fmt}, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert thought == THOUGHT and answer == r.output_text
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    c.close()


def test_qwen3_thinking_as_anthropic_thinking_block(family_servers):
    anthropic = pytest.importorskip("anthropic")
    server = family_servers["qwen3"]
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as a:
        kw = dict(model="tiny-qwen3", max_tokens=12, messages=[{"role": "user", "content": "Is it?"}],
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
        m = a.messages.create(**kw)
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == THOUGHT
        with a.messages.stream(**kw) as s:
            events = list(s)
        thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                          and e.delta.type == "thinking_delta")
        assert thought == THOUGHT
