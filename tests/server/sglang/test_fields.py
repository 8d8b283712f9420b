"""SGLang's request fields over sgrt's native HTTP API, against the real server (uvicorn on
loopback) over the default model: what an SGLang router forwards is accepted, ``no_stop_trim``
and SGLang's spellings are honoured, what sgrt cannot do is a 400 naming the field, and a field
SGLang does not have either stays a 400."""
from __future__ import annotations

import logging

import pytest

from sgrt.server.sglang import fields as sglang_fields

from tests.server.conftest_http import http_engine, http_server, raw  # noqa: F401 - fixtures

PROMPT = "Three colours, one per line:\n1."
#: The /generate body as sglang-router 0.3.2 forwards ``{"text", "sampling_params"}`` (captured
#: from the router in front of a recording server): every GenerateReqInput field it knows.
ROUTER_EXTRAS = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                 "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                 "return_entropy": False}


def _generate(url: str, body: dict) -> tuple[int, dict]:
    status, _, out = raw(url, "POST", "/generate", body)
    return status, out


def test_router_body_is_accepted_and_answers_as_the_plain_one(http_server):
    plain = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    status, want = _generate(http_server.url, plain)
    assert status == 200, want
    status, got = _generate(http_server.url, {**plain, **ROUTER_EXTRAS})
    assert status == 200, got
    assert got["text"] == want["text"] and got["meta_info"]["completion_tokens"] == 6
    # The router's /v1/completions extras.
    status, _, out = raw(http_server.url, "POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "no_stop_trim": False, "ignore_eos": False,
        "skip_special_tokens": True, "return_hidden_states": False, "echo": False})
    assert status == 200 and out["choices"][0]["text"] == want["text"], out


def test_no_stop_trim_keeps_the_stop_string(http_server):
    status, whole = _generate(http_server.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 16}})
    assert status == 200
    text = whole["text"]
    # A stop string from the greedy continuation itself, past its first characters.
    start = next(i for i in range(3, len(text)) if not text[i].isspace())
    stop = text[start:start + 2]
    cut = text.find(stop)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "stop": [stop]}}
    status, trimmed = _generate(http_server.url, body)
    assert status == 200 and trimmed["text"] == text[:cut]
    body["sampling_params"]["no_stop_trim"] = True
    status, kept = _generate(http_server.url, body)
    assert status == 200 and kept["text"] == text[:cut] + stop
    assert kept["meta_info"]["finish_reason"] == trimmed["meta_info"]["finish_reason"] == "stop"
    # The same over /v1/completions (SGLang's extra field there).
    status, _, out = raw(http_server.url, "POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop], "no_stop_trim": True})
    assert status == 200 and out["choices"][0]["text"] == text[:cut] + stop


def test_sglang_spellings_are_honoured(http_server):
    status, short = _generate(http_server.url, {"text": PROMPT, "sampling_params": {"max_tokens": 3}})
    assert status == 200
    status, out = _generate(http_server.url, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 3, "min_new_tokens": 3, "n": 1, "spaces_between_special_tokens": True}})
    assert status == 200 and out["text"] == short["text"] and out["meta_info"]["completion_tokens"] == 3
    sampled = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}}
    status, a = _generate(http_server.url, sampled)
    status2, b = _generate(http_server.url, {"text": PROMPT, "sampling_params": {
        "max_tokens": 8, "temperature": 1.0, "seed": 7}})
    assert status == status2 == 200 and a["text"] == b["text"]
    status, out = _generate(http_server.url, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 3, "min_new_tokens": 4}})
    assert status == 400 and out["error"]["param"] == "sampling_params.min_tokens", out


@pytest.mark.parametrize("extra, param", [
    ({"image_data": "http://example.invalid/cat.png"}, "image_data"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"token_ids_logprob": [1, 2]}, "token_ids_logprob"),
    ({"background": True}, "background"),
    ({"data_parallel_rank": 1}, "data_parallel_rank"),
    ({"sampling_params": {"max_new_tokens": 2, "ebnf": 'root ::= "a"'}}, "sampling_params.ebnf"),
    ({"sampling_params": {"max_new_tokens": 2, "n": 2}}, "sampling_params.n"),
    ({"sampling_params": {"max_new_tokens": 2, "stop_regex": "a+"}}, "sampling_params.stop_regex"),
    ({"sampling_params": {"max_tokens": 2, "max_new_tokens": 2}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_new_tokens": 2, "no_stop_trim": "yes"}}, "sampling_params.no_stop_trim"),
    # Not SGLang's either: unknown fields stay a 400.
    ({"not_a_field": 1}, None),
    ({"sampling_params": {"max_new_tokens": 2, "not_a_field": 1}}, "sampling_params.not_a_field"),
])
def test_what_sgrt_cannot_do_is_refused_by_name(http_server, extra, param):
    status, out = _generate(http_server.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, **extra})
    assert status == 400, out
    if param is not None:
        assert out["error"]["param"] == param, out
    else:
        assert "not_a_field" in out["error"]["message"], out


def test_completion_extras_refused_by_name(http_server):
    for extra, param in (({"ebnf": 'root ::= "a"'}, "ebnf"), ({"return_hidden_states": True}, "return_hidden_states"),
                         ({"rid": ["a", "b"]}, "rid")):
        status, _, out = raw(http_server.url, "POST", "/v1/completions",
                             {"prompt": PROMPT, "max_tokens": 2, **extra})
        assert status == 400 and out["error"]["param"] == param, out


def test_ignored_fields_are_accepted_with_one_warning(http_server, caplog):
    sglang_fields._warned.discard("priority")
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "priority": 5, "model": "anything",
            "log_metrics": False, "extra_key": "tenant-a"}
    with caplog.at_level(logging.WARNING, logger="sgrt.server.http"):
        for _ in range(2):
            status, out = _generate(http_server.url, body)
            assert status == 200 and out["meta_info"]["completion_tokens"] == 2
    warnings = [r.getMessage() for r in caplog.records if "priority" in r.getMessage()]
    assert len(warnings) == 1 and "ignored" in warnings[0], warnings


def test_model_and_server_info_name_the_served_model(http_server):
    """An SGLang router learns a worker's model from these (and lists it in its /v1/models)."""
    from tests.server.conftest_http import MODEL_NAME

    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        status, _, info = raw(http_server.url, "GET", path)
        assert status == 200 and info["model_path"] == MODEL_NAME and info["is_generation"] is True, (path, info)
    status, _, info = raw(http_server.url, "GET", "/server_info")
    assert info["served_model_name"] == MODEL_NAME and info["dp_size"] == info["tp_size"] == 1


def test_router_chat_extras_are_accepted(http_server):
    """What sglang-router and vllm-router add to /v1/chat/completions."""
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "temperature": 0}
    status, _, want = raw(http_server.url, "POST", "/v1/chat/completions", body)
    assert status == 200, want
    extras = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
              "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
              "return_hidden_states": False, "include_reasoning": True}
    status, _, got = raw(http_server.url, "POST", "/v1/chat/completions", {**body, **extras})
    assert status == 200 and got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    status, _, out = raw(http_server.url, "POST", "/v1/chat/completions", {**body, "continue_final_message": True})
    assert status == 400 and out["error"]["param"] == "continue_final_message", out
