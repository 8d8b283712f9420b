"""Chat templates by name, for models whose files carry none (``--chat-template NAME|FILE``).

A GGUF without ``tokenizer.chat_template`` (Gemma 3 270M's Q4_K_M file) or an HF folder without
one can still chat once given a template: a name below, or a Jinja file in the format of HF's
``chat_template`` (``messages``, ``add_generation_prompt``, ``bos_token``). The named templates
are written for sgrt from each family's published turn format; a model's own template, when it
has one, is always the better choice. Standard library and jinja2 only: the command line checks a
template before it loads the model.
"""
from __future__ import annotations

from pathlib import Path

from sgrt.errors import InvalidRequest

# ChatML (SmolLM2, Qwen2 / Qwen3): <|im_start|>role\ncontent<|im_end|>\n.
_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Gemma (2, 3): user / model turns only; a system message is put at the start of the next user
# turn, as Gemma's own templates do.
_GEMMA = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- set ns.system = message['content'] | trim ~ '\\n\\n' %}"
    "{%- else %}"
    "{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\\n' }}"
    "{%- if message['role'] == 'user' %}{{- ns.system }}{%- set ns.system = '' %}{%- endif %}"
    "{{- message['content'] | trim ~ '<end_of_turn>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Llama 3.x instruct: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>.
_LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\\n\\n' ~ message['content'] | trim"
    " ~ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Phi-3 / 3.5 / Phi-4-mini: <|role|>\ncontent<|end|>\n.
_PHI3 = (
    "{%- for message in messages %}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

#: name -> Jinja text.
NAMED_CHAT_TEMPLATES: dict[str, str] = {"chatml": _CHATML, "gemma": _GEMMA, "llama3": _LLAMA3, "phi3": _PHI3}

# The template to suggest for a family whose file carries none.
_FAMILY_TEMPLATE = {"llama": "llama3", "qwen2": "chatml", "qwen3": "chatml", "gemma3": "gemma", "phi3": "phi3"}


def suggested_template(family: str | None) -> str | None:
    """The named template of ``family``'s turn format (``"gemma3"`` -> ``"gemma"``), or None."""
    return _FAMILY_TEMPLATE.get(family or "")


def resolve_chat_template(value: str, flag: str = "--chat-template") -> str:
    """The Jinja text ``value`` names: a name of :data:`NAMED_CHAT_TEMPLATES`, a file, or
    ``@file``; checked to parse.

    Raises:
        InvalidRequest: (field ``chat_template``) neither a name nor a readable file, or text
            that is not a Jinja template (the message names ``flag``, the line and the error).
    """
    names = ", ".join(NAMED_CHAT_TEMPLATES)
    text = NAMED_CHAT_TEMPLATES.get(value.strip().lower())
    if text is None:
        path = Path(value[1:] if value.startswith("@") else value).expanduser()
        if not path.is_file():
            raise InvalidRequest(f"{flag} {value!r} is neither a template name ({names}) nor a file",
                                 field="chat_template")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"{flag}: cannot read {path}: {e}", field="chat_template") from None
    check_chat_template(text, flag)
    return text


def check_chat_template(text: str, flag: str = "--chat-template") -> None:
    """Raise ``InvalidRequest`` (field ``chat_template``) unless ``text`` parses as Jinja."""
    import jinja2

    if not text.strip():
        raise InvalidRequest(f"{flag}: the template is empty", field="chat_template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequest(f"{flag}: not a Jinja template: line {e.lineno}: {e.message}",
                             field="chat_template") from None
