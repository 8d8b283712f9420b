"""``RuntimeEndpoint`` (sgrt/backends/http.py): the native path against an sgrt server, and the
generic OpenAI paths (dialects ``openai``, ``sglang``, ``vllm``) exercised against the same server
with the dialect forced."""
from __future__ import annotations

import re
import socket
import threading
import time

import pytest

import sgrt
from sgrt.backends.http import RuntimeEndpoint
from sgrt.errors import InvalidRequest, RequestAborted

from tests.server.conftest_http import MODEL_NAME, http_engine, http_server, needs_constraints, wait_idle  # noqa: F401

PROMPT = "Decide if the statement is True or False.\nStatement: Fish can fly to the moon.\nAnswer:"


@pytest.fixture(scope="module")
def endpoint(http_server):
    ep = RuntimeEndpoint(http_server.url + "/v1")  # a trailing /v1 is accepted
    yield ep
    ep.shutdown()


def test_detects_sgrt_and_generates(endpoint, http_engine):
    assert endpoint.dialect == "sgrt" and endpoint.model == MODEL_NAME
    out = endpoint.generate(PROMPT, {"max_tokens": 4, "return_logprob": True, "top_logprobs_num": 2})
    meta = out.meta_info
    assert meta["prompt_tokens"] == endpoint.count_tokens(PROMPT) == len(http_engine.tokenizer.encode(PROMPT))
    assert meta["finish_reason"] in ("stop", "length") and meta["completion_tokens"] <= 4
    assert [t for _, t, _ in meta["output_token_logprobs"]] == meta["output_token_ids"]
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])
    batch = endpoint.generate_batch([PROMPT, PROMPT + " True"], [{"max_tokens": 4}, {"max_tokens": 2}])
    assert batch[0].text == out.text and batch[1].meta_info["completion_tokens"] <= 2
    info = endpoint.get_server_info()
    assert info["dialect"] == "sgrt" and info["health"]["status"] == "ok"


def test_select_scores_match_the_local_backend(endpoint, http_engine):
    from sgrt.backends.local import LocalBackend

    choices = ["True", "False", "Unknown"]
    remote = endpoint.score_choices(PROMPT, choices, unconditional=True)
    local = LocalBackend(http_engine).score_choices(PROMPT, choices, unconditional=True)
    for r, lo in zip(remote, local):
        assert r.token_ids == lo.token_ids
        assert r.token_logprobs == pytest.approx(lo.token_logprobs, abs=1e-4)
        assert r.unconditional_logprobs[1:] == pytest.approx(lo.unconditional_logprobs[1:], abs=1e-4)
        # The option's own scored tokens, alone (SGLang's rule): one entry each, the first None.
        assert len(r.unconditional_logprobs) == len(r.token_ids) and r.unconditional_logprobs[0] is None
        assert r.cached_tokens >= r.prompt_tokens - 2  # the prompt was prefilled once, then reused
    meta = endpoint.cache_prefix(PROMPT)
    assert meta["cached_tokens"] >= meta["prompt_tokens"] - 1


def test_prompt_logprobs_match_the_local_backend(endpoint, http_engine):
    # What a gen's meta info carries with logprob_start_len (issue 44): the prompt's entries.
    from sgrt.backends.local import LocalBackend

    params = {"max_tokens": 2, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    remote = endpoint.generate(PROMPT, params).meta_info
    local = LocalBackend(http_engine).generate(PROMPT, params).meta_info
    assert len(remote["input_token_logprobs"]) == remote["prompt_tokens"]
    assert [e[1:] for e in remote["input_token_logprobs"]] == [e[1:] for e in local["input_token_logprobs"]]
    assert remote["input_token_logprobs"][0][0] is None
    assert [e[0] for e in remote["input_token_logprobs"][1:]] == pytest.approx(
        [e[0] for e in local["input_token_logprobs"][1:]], abs=1e-4)
    assert len(remote["input_top_logprobs"]) == len(local["input_top_logprobs"]) == remote["prompt_tokens"]


def test_stream_close_and_abort_free_the_request(endpoint, http_engine):
    wait_idle(http_engine)
    aborted = http_engine.stats()["aborted"]
    stream = endpoint.generate_stream(PROMPT, {"max_tokens": 1000, "ignore_eos": True})
    pieces = [next(stream).text for _ in range(3)]
    assert len(pieces) == 3
    stream.close()  # closes the connection: the server aborts
    wait_idle(http_engine)
    assert http_engine.stats()["aborted"] == aborted + 1
    # abort(request_id) from another thread stops a running gen, which raises RequestAborted.
    errors: list[BaseException] = []

    def run() -> None:
        try:
            endpoint.generate(PROMPT, {"max_tokens": 1000, "ignore_eos": True}, request_id="rid-to-abort")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while http_engine.stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    endpoint.abort("rid-to-abort")
    t.join(timeout=300)
    assert errors and isinstance(errors[0], RequestAborted)
    wait_idle(http_engine)


def test_errors_map_to_sgrt_types(endpoint, http_engine):
    with pytest.raises(InvalidRequest) as e:
        endpoint.generate(PROMPT, {"max_tokens": -1})  # refused by SamplingParams, before sending
    assert e.value.field == "max_tokens"
    # What only the server can check (the model's vocabulary) comes back as the same type.
    with pytest.raises(InvalidRequest) as e:
        endpoint.generate(PROMPT, {"max_tokens": 2, "stop_token_ids": [10**6]})
    assert "stop_token_ids" in e.value.field
    from sgrt.server.http.server import HttpServerThread

    with HttpServerThread(http_engine, model_name=MODEL_NAME, auth_token="tok") as server:
        with pytest.raises(InvalidRequest) as e:
            RuntimeEndpoint(server.url)
        assert e.value.field == "api_key"
        assert RuntimeEndpoint(server.url, api_key="tok").generate(PROMPT, {"max_tokens": 1}).text is not None
    # NOTE: the port stays bound (not listening) while the client tries it: nobody else can take
    # it meanwhile, and a connect to it is refused.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with pytest.raises(ConnectionError):
            RuntimeEndpoint(f"http://127.0.0.1:{s.getsockname()[1]}")


def test_429_is_retried(http_engine):
    from sgrt.server.http.server import HttpServerThread

    with HttpServerThread(http_engine, model_name=MODEL_NAME, max_queue=1) as server:
        ep = RuntimeEndpoint(server.url, max_retries=600)  # Retry-After: 1 -> up to 10 min of retries
        results: list = []
        errors: list = []

        def one() -> None:
            try:
                results.append(ep.generate(PROMPT, {"max_tokens": 6}))
            except Exception as e:  # kept so the assertion shows why a request gave up
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        # No short deadline: on a loaded 2-core machine the queued requests wait out several
        # Retry-After waits (1 s each) behind the running one; the retries bound the wait.
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        assert len(results) == 3 and len({r.text for r in results}) == 1


# ---- other OpenAI-compatible servers (dialect forced, same server) --------------------------------


@pytest.fixture(scope="module")
def generic(http_server):
    ep = RuntimeEndpoint(http_server.url, dialect="openai")
    yield ep
    ep.shutdown()


def test_openai_dialect_gen_stream_and_refusals(generic, endpoint):
    native = endpoint.generate(PROMPT, {"max_tokens": 6})
    out = generic.generate(PROMPT, {"max_tokens": 6, "stop": [], "return_logprob": True, "top_logprobs_num": 1})
    assert out.text == native.text
    assert out.meta_info["completion_tokens"] == native.meta_info["completion_tokens"]
    assert len(out.meta_info["output_token_logprobs"]) == out.meta_info["completion_tokens"]
    chunks = list(generic.generate_stream(PROMPT, {"max_tokens": 6}))
    assert "".join(c.text for c in chunks) == native.text and chunks[-1].finished
    assert chunks[-1].meta_info["completion_tokens"] == native.meta_info["completion_tokens"]
    for params, field in [({"regex": "a+"}, "regex"), ({"grammar": "start: 'a'"}, "grammar"),
                          ({"top_k": 5}, "top_k"), ({"logprob_start_len": 0}, "logprob_start_len")]:
        with pytest.raises(InvalidRequest) as e:
            generic.generate(PROMPT, {"max_tokens": 2, **params})
        assert e.value.field == field and "(dialect 'openai')" in str(e.value) and f"gen({field}=" in str(e.value)
    assert generic.cache_prefix(PROMPT) == {}


def test_openai_dialect_select_by_echo(generic, endpoint, http_engine):
    choices = [" True", " False"]
    by_echo = generic.score_choices(PROMPT, choices)
    native = endpoint.score_choices(PROMPT, choices)
    for a, b in zip(by_echo, native):
        assert a.token_texts == b.token_texts
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


def test_openai_dialect_roles_need_a_template(http_server):
    @sgrt.function
    def chat(s):
        s += sgrt.user("Hi")
        s += sgrt.assistant(sgrt.gen("a", max_tokens=2))

    @sgrt.function
    def plain(s):
        s += "Hello" + sgrt.gen("a", max_tokens=2)

    ep = RuntimeEndpoint(http_server.url, dialect="openai")
    assert isinstance(plain.run(backend=ep)["a"], str)
    with pytest.raises(InvalidRequest) as e:
        chat.run(backend=ep)["a"]
    assert e.value.field == "chat_template"
    from sgrt.lang.chat_template import CHATML

    with_template = RuntimeEndpoint(http_server.url, dialect="openai", chat_template=CHATML)
    assert isinstance(chat.run(backend=with_template)["a"], str)


@needs_constraints
def test_sglang_dialect_constraints_as_extra_fields(http_server):
    ep = RuntimeEndpoint(http_server.url, dialect="sglang")
    out = ep.generate("My favourite number is ", {"max_tokens": 6, "regex": "[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{2}", out.text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = ep._completion_body("x", {"json_schema": schema, "regex": None, "top_k": 3}, "rid-1")
    assert body["json_schema"] == '{"type": "object", "properties": {"ok": {"type": "boolean"}}, ' \
                                  '"required": ["ok"], "additionalProperties": false}'
    assert body["top_k"] == 3 and body["rid"] == "rid-1"
    out = ep.generate("Answer in JSON: ", {"max_tokens": 12, "json_schema": schema})
    assert out.text.replace(" ", "") in ('{"ok":true}', '{"ok":false}') or out.meta_info["finish_reason"] == "length"


def test_vllm_dialect_request_shape(http_server):
    ep = RuntimeEndpoint(http_server.url, dialect="vllm")
    body = ep._completion_body("x", {"max_tokens": 3, "regex": "a+", "min_tokens": 2, "return_logprob": True,
                                     "top_logprobs_num": 1, "jump_forward": "exact"}, None)
    assert body["structured_outputs"] == {"regex": "a+"} and body["min_tokens"] == 2
    assert body["logprobs"] == 1 and body["return_tokens_as_token_ids"] is True
    assert "jump_forward" not in body and "rid" not in body
    assert ep._token_id("token_id:42") == 42 and ep._token_id("hello") is None


# ---- several servers behind one program (prefix affinity) -----------------------------------------


def test_several_servers_keep_a_programs_prefix_on_one(http_server, http_engine):
    from sgrt.server.http.server import HttpServerThread

    @sgrt.function
    def prog(s, topic):
        s += f"You answer questions about {topic}.\nQuestion: Is it big?\nAnswer:"
        s += sgrt.select("a", choices=[" Yes", " No"])
        forks = s.fork(2)
        for f in forks:
            f += sgrt.gen("more", max_tokens=2)
        forks.join()

    with HttpServerThread(http_engine, model_name=MODEL_NAME) as second:
        ep = RuntimeEndpoint([http_server.url, second.url + "/v1"])
        assert [c.base_url for c in ep.clients] == [http_server.url, second.url]
        # Unrelated prompts spread over both servers; a prompt that extends one sent before
        # follows it, whatever comes after.
        picks = {ep.client_for(f"topic {i}: " + "x" * 100).base_url for i in range(64)}
        assert picks == {http_server.url, second.url}
        for i in (3, 40):
            first = ep.client_for(f"topic {i}: " + "x" * 100)
            assert all(ep.client_for(f"topic {i}: " + "x" * 100 + tail) is first for tail in ("a", "b" * 500))
        for topic in ("whales", "cities"):
            for c in ep.clients:
                c.recorder = []
            state = prog.run(topic=topic, backend=ep)
            assert state["a"] in (" Yes", " No") and len(state.text()) > 60
            used = [c.base_url for c in ep.clients
                    if any(ex["path"] in ("/generate", "/v1/completions") for ex in c.recorder)]
            assert len(used) == 1, used  # select, the fork's prefix and both branches: one server
        ep.shutdown()
        with pytest.raises(InvalidRequest) as e:
            RuntimeEndpoint([http_server.url, second.url], model="another-model")
        assert e.value.field in ("base_url", "model") or "another-model" in str(e.value)
