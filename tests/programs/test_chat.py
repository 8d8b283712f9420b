"""programs/chat.py: a multi-turn conversation whose later turns come from the prefix cache."""
from __future__ import annotations

import pytest

from programs.chat import chat


def test_two_turns_alternate_roles_and_reuse_the_cache(runtime):
    st = chat.run(turns=["Hi! Who are you?", "Name a colour."], max_tokens=12)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    replies = st["replies"]
    assert len(replies) == 2 and all(isinstance(r, str) for r in replies)
    assert [msgs[2]["content"], msgs[4]["content"]] == replies == [st["reply_0"], st["reply_1"]]
    m0, m1 = st.get_meta_info("reply_0"), st.get_meta_info("reply_1")
    assert 0 < m0["completion_tokens"] <= 12 and 0 < m1["completion_tokens"] <= 12
    # Turn 2's prompt is turn 1's prompt + reply + the new message: all of turn 1's prompt is cached.
    assert m1["cached_tokens"] >= m0["prompt_tokens"]
    assert m1["prompt_tokens"] - m1["cached_tokens"] < 40
    # The transcript is what the model's own chat template renders.
    assert st.text() == runtime.apply_chat_template(msgs, add_generation_prompt=False)


def test_history_is_replayed_not_generated(runtime):
    history = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": "Nice to meet you, Ada."}]
    st = chat.run(turns=["What is my name?"], history=history, system="Be brief.", max_tokens=8)
    msgs = st.messages()
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[1:3] == history
    assert [m["role"] for m in msgs[3:]] == ["user", "assistant"]
    assert st["replies"] == [msgs[4]["content"]]


def test_bad_arguments_raise(runtime):
    with pytest.raises(ValueError, match="at least one turn"):
        chat.run(turns=[])
    with pytest.raises(ValueError, match="history roles"):
        chat.run(turns=["hi"], history=[{"role": "tool", "content": "x"}])
