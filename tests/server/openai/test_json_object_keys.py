"""Issue 18, item 7, over HTTP: ``response_format: {"type": "json_object"}`` never repeats a key,
through the official ``openai`` client (completions and chat)."""
from __future__ import annotations

import json

from tests.server.conftest_http import (  # noqa: F401 - fixtures
    MODEL_NAME,
    client,
    http_engine,
    http_server,
    needs_constraints,
)


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@needs_constraints
def test_json_object_never_repeats_a_key(client):
    # Every line of the prompt repeats "a"; without the key check the model copies it.
    prompt = 'Data:\n{"a":1,"a":2,"b":3}\n{"a":1,"a":2,"b":3}\n{"a":1,"a":2,"b":3}\n'
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.text
    value = json.loads(choice.text, object_pairs_hook=_no_duplicates)
    assert set(value) >= {"a", "b"}
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Copy this JSON: {"id": 1, "id": 2, "id": 3}'}])
    text = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        json.loads(text, object_pairs_hook=_no_duplicates)
