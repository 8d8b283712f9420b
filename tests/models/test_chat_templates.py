"""Named chat templates and ``--chat-template FILE`` (issue 41): each name renders its family's
turn format, a file or ``@file`` is read, and what is neither, or not Jinja, is refused naming
the flag (and the line). Torch-free: the command line checks a template before the load."""
from __future__ import annotations

import jinja2
import pytest

from sgrt.errors import InvalidRequest
from sgrt.models.chat_templates import NAMED_CHAT_TEMPLATES, resolve_chat_template, suggested_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]

EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
    "gemma": "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
             "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<bos><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n"
            "<|assistant|>\n",
}


@pytest.mark.parametrize("name", sorted(NAMED_CHAT_TEMPLATES))
def test_named_templates_render_their_turn_format(name):
    text = resolve_chat_template(name.upper())  # (names are case-blind)
    rendered = jinja2.Environment().from_string(text).render(messages=MESSAGES, add_generation_prompt=True,
                                                             bos_token="<bos>")
    assert rendered == EXPECTED[name]


def test_families_suggest_their_template():
    assert [suggested_template(f) for f in ("gemma3", "qwen3", "llama", "phi3", "mamba", None)] == \
        ["gemma", "chatml", "llama3", "phi3", None, None]


def test_a_file_or_at_file_is_read(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_chat_template(str(path)) == resolve_chat_template(f"@{path}") == path.read_text()


@pytest.mark.parametrize("content, message", [
    (None, "--chat-template 'NAME' is neither a template name (chatml, gemma, llama3, phi3) nor a file"),
    ("  \n", "--chat-template: the template is empty"),
    ("{% for m in messages %}{{ m }}", "--chat-template: not a Jinja template: line 1: Unexpected end of template"),
])
def test_bad_values_are_refused_naming_the_flag(tmp_path, content, message):
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_text(content)
    value = str(path) if content is not None else "NAME"
    with pytest.raises(InvalidRequest) as info:
        resolve_chat_template(value)
    assert info.value.field == "chat_template"
    assert str(info.value).startswith(message)
