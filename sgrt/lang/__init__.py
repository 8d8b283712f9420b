"""The DSL: prompt programs as Python functions over a state ``s``.

    import sgrt

    @sgrt.function
    def qa(s, question):
        s += sgrt.user(question)
        s += sgrt.assistant(sgrt.gen("answer", max_tokens=32))

    sgrt.set_default_backend(sgrt.Runtime())
    print(qa.run(question="What is 2 + 2?")["answer"])

Names follow SGLang's frontend language; see ``sgrt.lang.api`` for the differences.
"""
from __future__ import annotations

from sgrt.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from sgrt.chat_template import ChatTemplate, derive_chat_template
from sgrt.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from sgrt.lang.function import CompiledFunction, Function, function
from sgrt.lang.interpreter import ProgramState, ProgramStateGroup
from sgrt.lang.tracer import TracedProgram

__all__ = [
    "ChatTemplate", "ChoicesDecision", "ChoicesSamplingMethod", "CompiledFunction", "Function",
    "ProgramState", "image", "separate_reasoning", "video",
    "ProgramStateGroup", "TracedProgram", "assistant", "assistant_begin", "assistant_end",
    "derive_chat_template", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_default_backend", "get_server_info", "greedy_token_selection", "select",
    "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
