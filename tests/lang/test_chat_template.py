"""Deriving role prefixes/suffixes from chat templates with sentinel contents (no model)."""
from __future__ import annotations

import pytest

from sgrt.errors import InvalidRequest
from sgrt.lang.chat_template import CHATML, derive_chat_template
from sgrt.lang.transcript import Transcript

from .fake_backend import CHATML_WITH_DEFAULT_SYSTEM, DEFAULT_SYSTEM, render_template

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
    "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Gemma refuses system messages.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# Contents are not between a fixed prefix and suffix: the user's text is repeated.
WEIRD = (
    "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}|{{ m['content'] }}]"
    "{% endfor %}"
)


def renderer(source, bos=""):
    return lambda msgs, gen: render_template(source, msgs, gen, bos_token=bos)


def test_chatml_with_default_system_prompt():
    t = derive_chat_template(renderer(CHATML_WITH_DEFAULT_SYSTEM))
    assert t.role_prefix_and_suffix == CHATML.role_prefix_and_suffix
    assert t.default_system_prompt == DEFAULT_SYSTEM
    assert t.stop_str == ("<|im_end|>",)


def test_transcript_matches_template_rendering():
    render = renderer(CHATML_WITH_DEFAULT_SYSTEM)
    t = derive_chat_template(render)
    tr = Transcript(t)
    for role, content in [("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]:
        tr.begin_role(role)
        tr.fill(content)
        tr.end_role(role)
    tr.begin_role("assistant")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]
    assert tr.text == render(msgs, True)
    # The default system message the template would insert is part of the transcript too.
    assert tr.messages == [{"role": "system", "content": DEFAULT_SYSTEM}] + msgs


def test_llama3_strips_bos():
    t = derive_chat_template(renderer(LLAMA3, "<|begin_of_text|>"),
                             bos_token="<|begin_of_text|>")
    assert t.prefix_and_suffix("user") == ("<|start_header_id|>user<|end_header_id|>\n\n",
                                           "<|eot_id|>")
    assert t.prefix_and_suffix("system")[0] == "<|start_header_id|>system<|end_header_id|>\n\n"
    assert t.default_system_prompt is None


def test_template_without_system_role_uses_user_markers():
    t = derive_chat_template(renderer(GEMMA, "<bos>"), bos_token="<bos>")
    assert t.prefix_and_suffix("user") == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert t.prefix_and_suffix("assistant") == ("<start_of_turn>model\n", "<end_of_turn>\n")
    assert t.prefix_and_suffix("system") == t.prefix_and_suffix("user")


def test_underivable_template_raises():
    with pytest.raises(InvalidRequest) as e:
        derive_chat_template(renderer(WEIRD))
    assert e.value.field == "chat_template"


class _NoTemplateBackend:
    """A backend whose model has no chat template: its apply function raises the tokenizer's
    typed error (as Gemma 3 270M's GGUF does)."""

    def bos_token(self) -> str:
        return "<bos>"

    def apply_chat_template(self, messages, add_generation_prompt=False) -> str:
        raise InvalidRequest("this model's tokenizer has no chat template", field="messages")


def test_a_model_without_a_chat_template_gets_plain():
    """Reported: every DSL program on Gemma 3 270M failed, the missing template's error wrapped as
    an underivable one; a model with no template gets PLAIN, as chat_template_for promises."""
    from sgrt.lang.chat_template import PLAIN, chat_template_for

    assert chat_template_for(_NoTemplateBackend()) is PLAIN
