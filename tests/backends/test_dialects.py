"""RuntimeEndpoint's per-engine dialects against recorded runs of real engines.

``recorded_engines.json`` holds every HTTP exchange of ``bench/scale_out.py --record`` against
real servers (sgrt, and the other engines that ran: see its keys), with the outcome of each
primitive. Replaying those exchanges through a fake transport checks, per engine:

- the dialect is detected from what the server said (``/v1/models``, headers, probes);
- each primitive sends exactly the requests the real run sent (a request the recording does
  not hold fails the replay), and its answer is parsed into the same outcome (the checks in
  ``bench/scale_out.py`` validate values: regex matches, schema-valid JSON, select picks one of
  the options, the streamed pieces add up to the variable);
- each refused primitive is an ``InvalidRequest`` whose message names the engine and the
  primitive, and whose ``field`` names the field.
"""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.scale_out import CASES, MODEL_NAME, run_cases
from sgrt.backends.dialects import DIALECTS
from sgrt.backends.http import RuntimeEndpoint
from sgrt.errors import InvalidRequest

RECORDED = json.loads((Path(__file__).parent / "recorded_engines.json").read_text())
#: Every case, the tool call included (the openai SDK sends it through the endpoint's client).
ENDPOINT_CASES = tuple(name for name, _ in CASES)


def _canonical(body: Any) -> Any:
    # NOTE: request ids are fresh uuids each run; everything else must be identical.
    if isinstance(body, dict):
        return {k: _canonical(v) for k, v in body.items() if k != "rid"}
    if isinstance(body, list):
        return [_canonical(v) for v in body]
    return body


def _unurl(text: str) -> str:
    return re.sub(r"https?://\S+", "URL", text)


class ReplayTransport:
    """Answers each request with a recorded exchange that has the same method, path, stream
    flag and JSON body; each recorded exchange answers once."""

    def __init__(self, exchanges: list[dict[str, Any]]):
        self.pending = list(exchanges)
        self.lock = threading.Lock()

    def send(self, method: str, path: str, payload: bytes | None, stream: bool) -> tuple[int, dict[str, str], bytes]:
        request = None if payload is None else _canonical(json.loads(payload))
        with self.lock:
            for i, ex in enumerate(self.pending):
                if (ex["method"], ex["path"], ex["stream"]) == (method, path, stream) \
                        and _canonical(ex["request"]) == request:
                    del self.pending[i]
                    return ex["status"], dict(ex["headers"]), ex["response"].encode()
        raise AssertionError(f"the recorded run never sent {method} {path} {json.dumps(request)[:300]}")


@pytest.fixture(scope="module")
def hf_folder() -> str:
    from sgrt.models.loader import tokenizer_folder

    return str(tokenizer_folder(MODEL_NAME))


def _endpoint(engine: str, hf_folder: str, **kw: Any) -> tuple[RuntimeEndpoint, ReplayTransport]:
    transport = ReplayTransport(RECORDED[engine]["exchanges"])
    ep = RuntimeEndpoint("http://recorded.invalid:1", model=MODEL_NAME, transport=transport,
                         tokenizer=None if engine == "sgrt" else hf_folder, **kw)
    return ep, transport


def test_recordings_cover_sgrt_and_a_real_engine():
    assert "sgrt" in RECORDED and set(RECORDED) & {"vllm", "llama-cpp-python", "llamacpp"}
    for rec in RECORDED.values():
        assert rec["exchanges"] and set(rec["rows"]) == {name for name, _ in CASES}


#: Rows a real engine itself gets wrong outside RuntimeEndpoint (the tool call goes straight to
#: the engine's chat API through the openai SDK), with what the recording shows.
ENGINE_FAULTS = {
    # NOTE: llama.cpp (xllamacpp 2026.10.11549) logs "Wrong type supplied for parameter
    # 'tool_choice'" for a named tool_choice object and falls back to "auto", and SmolLM2's chat
    # template has no tool format ("Content-only"), so it answers in prose: its fault, kept visible.
    ("llamacpp", "tools (OpenAI API)"): "no tool call",
}


def test_no_recorded_primitive_is_wrong():
    """Each primitive of each real engine works or is refused by name, never a wrong answer
    (vLLM's tool call was one: its arguments came back as a JSON string holding JSON until the
    bench started it with --tool-strict-level parameter; llama.cpp's JSON Schema was another
    while the dialect sent it as response_format, which its /v1/completions ignores). Every
    primitive that goes through RuntimeEndpoint is right on every engine; the one exception is
    llama.cpp's own chat API with a named tool_choice (:data:`ENGINE_FAULTS`)."""
    for engine, rec in RECORDED.items():
        wrong = {name: row for name, row in rec["rows"].items()
                 if row[0] not in ("works", "refused") and (engine, name) not in ENGINE_FAULTS}
        assert not wrong, (engine, wrong)
    for (engine, name), why in ENGINE_FAULTS.items():
        if engine in RECORDED:
            assert RECORDED[engine]["rows"][name][0] == "wrong" and why in RECORDED[engine]["rows"][name][1]
    assert RECORDED["vllm"]["rows"]["tools (OpenAI API)"][0] == "works"


def test_llamacpp_does_every_endpoint_primitive():
    """llama.cpp's server (xllamacpp's build, with llguidance): regex and Lark as llguidance
    grammars, JSON Schema by its json_schema field, select by forced tokens, all of them
    checked on real answers (the regex matched, the JSON fit the schema, the Lark answer was
    yes / no)."""
    rows = RECORDED["llamacpp"]["rows"]
    assert {n for n, r in rows.items() if r[0] != "works"} == {n for e, n in ENGINE_FAULTS if e == "llamacpp"}
    sent = [ex["request"] for ex in RECORDED["llamacpp"]["exchanges"] if ex["path"] == "/v1/completions"]
    grammars = [b["grammar"] for b in sent if "grammar" in b]
    assert all(g.startswith("%llguidance {}\n") for g in grammars) and len(grammars) >= 4
    assert not any("response_format" in b for b in sent)


@pytest.mark.parametrize("engine", sorted(RECORDED))
def test_replayed_run_matches_the_real_one(engine, hf_folder):
    rec = RECORDED[engine]
    ep, transport = _endpoint(engine, hf_folder)
    # NOTE: a router's key names the router; its dialect is the one that passes through it.
    assert ep.dialect == rec["dialect"] == (engine if engine in DIALECTS else "sglang")
    rows = run_cases(ep)
    for name in ENDPOINT_CASES:
        status, detail = rows[name]
        assert status == rec["rows"][name][0], f"{engine} {name}: {status}: {detail}"
        if status == "refused":
            assert DIALECTS[rec["dialect"]].engine in detail
            assert _unurl(detail) == _unurl(rec["rows"][name][1])  # the same refusal, bar the server's URL
    assert not [(ex["method"], ex["path"]) for ex in transport.pending if ex["path"] != "/v1/models"]


#: Per dialect, primitives it cannot do: (sampling params, field, what the message names).
REFUSALS = {
    "llama-cpp-python": [({"json_schema": {"type": "integer"}}, "json_schema", "gen(json_schema=...)")],
    "llamacpp": [({"min_tokens": 1}, "min_tokens", "gen(min_tokens=...)"),
                 ({"stop_token_ids": [2]}, "stop_token_ids", "gen(stop_token_ids=...)"),
                 ({"logprob_start_len": 0}, "logprob_start_len", "gen(logprob_start_len=...)")],
    "vllm": [({"logprob_start_len": 0}, "logprob_start_len", "gen(logprob_start_len=...)"),
             ({"truncate": "left"}, "truncate", "gen(truncate=...)")],
    "openai": [({"regex": "a+"}, "regex", "gen(regex=...)"), ({"grammar": 'start: "a"'}, "grammar", "gen(grammar=...)"),
               ({"top_k": 5}, "top_k", "gen(top_k=...)")],
    "sglang": [({"grammar": 'start: "a"'}, "grammar", "gen(grammar=...)")],
}


@pytest.mark.parametrize("dialect", sorted(REFUSALS))
def test_unsupported_primitives_are_refused_by_name(dialect, hf_folder):
    # Any recorded server will do: the dialect is forced and nothing is sent for a refusal.
    engine = next(e for e in ("vllm", "llamacpp", "sgrt") if e in RECORDED)
    ep, transport = _endpoint(engine, hf_folder, dialect=dialect)
    sent = len(transport.pending)
    for params, field, primitive in REFUSALS[dialect]:
        with pytest.raises(InvalidRequest) as e:
            ep.generate("Hello", {"max_tokens": 2, **params})
        assert e.value.field == field
        assert primitive in str(e.value) and DIALECTS[dialect].engine in str(e.value), str(e.value)
    # Two constraints are refused by SamplingParams' own check (the one place), for every dialect.
    with pytest.raises(InvalidRequest, match="at most one") as e:
        ep.generate("Hello", {"max_tokens": 2, "regex": "a", "json_schema": {"type": "string"}})
    assert e.value.field == "json_schema"
    assert len(transport.pending) == sent  # refused before anything went out


def test_a_router_is_detected_before_what_its_workers_say():
    """sglang-router answers /v1/models itself (owned_by "local"); vllm-router forwards it (an
    sgrt worker's "sgrt"): both have a /workers list, and both get SGLang's dialect, the one
    whose fields pass through them. A plain sgrt server has no /workers."""
    from sgrt.backends.dialects import detect_dialect

    router = {"/workers": {"workers": [{"url": "http://w1"}]}}
    assert detect_dialect("local", {}, router.get) == "sglang"
    assert detect_dialect("sgrt", {"x-sgrt-version": "0.1.0"}, router.get) == "sglang"
    assert detect_dialect("sgrt", {"x-sgrt-version": "0.1.0"}, {}.get) == "sgrt"
    assert detect_dialect("vllm", {}, router.get) == "vllm"


def test_llamacpp_is_detected_by_what_it_says():
    """llama-server: owned_by "llamacpp" (the recorded answer), else its Server header, else its
    /props (a proxy in front of it that renames the owner and drops the header)."""
    from sgrt.backends.dialects import detect_dialect

    models = next(ex for ex in RECORDED["llamacpp"]["exchanges"] if ex["path"] == "/v1/models")
    card = json.loads(models["response"])["data"][0]
    assert card["owned_by"] == "llamacpp" and models["headers"].get("server") == "llama.cpp"
    assert detect_dialect(card["owned_by"], {}, {}.get) == "llamacpp"
    assert detect_dialect("someone", {"server": models["headers"]["server"]}, {}.get) == "llamacpp"
    props = {"/props": {"default_generation_settings": {"params": {}}, "total_slots": 4}}
    assert detect_dialect("someone", {}, props.get) == "llamacpp"
    assert detect_dialect("someone", {}, {}.get) == "openai"


def test_request_fields_per_dialect():
    """The same gen maps onto each engine's own field names."""
    params = {"max_tokens": 4, "json_schema": {"type": "integer"}, "top_k": 5, "repetition_penalty": 1.1,
              "return_logprob": True}
    vllm = DIALECTS["vllm"].completion_body("m", "p", params, None, "u")
    assert vllm["structured_outputs"] == {"json": {"type": "integer"}} and vllm["top_k"] == 5
    assert vllm["repetition_penalty"] == 1.1 and vllm["return_tokens_as_token_ids"] is True
    assert "guided_json" not in vllm and "response_format" not in vllm
    llama = DIALECTS["llamacpp"].completion_body("m", "p", params, None, "u")
    # NOTE: llama.cpp's /v1/completions ignores response_format; json_schema is its own field.
    assert llama["json_schema"] == {"type": "integer"} and "response_format" not in llama
    assert llama["repeat_penalty"] == 1.1 and "repetition_penalty" not in llama and llama["cache_prompt"] is True
    assert llama["logprobs"] == 1  # its n_probs: 0 would return no logprobs at all
    assert DIALECTS["llamacpp"].completion_body("m", "p", {"ignore_eos": True}, None, "u")["ignore_eos"] is True
    sglang = DIALECTS["sglang"].completion_body("m", "p", params, "rid-1", "u")
    assert sglang["json_schema"] == '{"type": "integer"}' and sglang["rid"] == "rid-1"


def test_llamacpp_grammars_are_llguidance_lark():
    """A regex becomes llguidance's own Lark form of it (what sgrt's default backend compiles),
    a Lark grammar goes as is, both behind the %llguidance line that sends them to llguidance
    in llama.cpp; what llguidance rejects is a GrammarError here, since llama.cpp answers an
    invalid llguidance grammar with an unconstrained 200."""
    import llguidance

    from sgrt.backends.dialects import forced_tokens_grammar, llguidance_grammar
    from sgrt.errors import GrammarError

    regex = r"a/b\d{2}"
    lark = llguidance_grammar(regex=regex)
    assert lark.startswith("%llguidance {}\n")
    expected = json.loads(llguidance.LLMatcher.grammar_from_regex(regex))["grammars"][0]["lark_grammar"]
    assert lark.split("\n", 1)[1] == expected
    assert llguidance_grammar(lark='start: "yes" | "no"') == '%llguidance {}\nstart: "yes" | "no"'
    # NOTE: llama.cpp ran `start: foo` unconstrained ("-by-date-" after "Hello"), HTTP 200.
    with pytest.raises(GrammarError) as e:
        llguidance_grammar(lark="start: foo")
    assert e.value.field == "grammar" and "foo" in str(e.value)
    body = DIALECTS["llamacpp"].completion_body("m", "p", {"max_tokens": 2, "regex": "[0-9]+"}, None, "u")
    assert body["grammar"].startswith("%llguidance") and "json_schema" not in body
    assert forced_tokens_grammar([9230, 12]) == "%llguidance {}\nstart: <[9230]> <[12]>"


def test_llamacpp_without_llguidance_refuses_by_name(hf_folder):
    """A llama.cpp built without llguidance (its JSON Schema grammar comes back as GBNF) aborts
    the whole process on an %llguidance grammar: regex, Lark and select are refused by name and
    none is sent; plain gen and JSON Schema still go."""
    exchanges = [dict(ex) for ex in RECORDED["llamacpp"]["exchanges"]]
    for ex in exchanges:
        if ex["path"] == "/completion":
            answer = json.loads(ex["response"])
            answer["generation_settings"]["grammar"] = 'root ::= "1" space\nspace ::= | " " | "\\n"{1,2} [ \\t]{0,20}\n'
            ex["response"] = json.dumps(answer)
    transport = ReplayTransport(exchanges)
    ep = RuntimeEndpoint("http://recorded.invalid:1", model=MODEL_NAME, transport=transport, tokenizer=hf_folder)
    assert ep.dialect == "llamacpp"
    rows = run_cases(ep)
    for name, primitive in (("regex", "gen(regex=...)"), ("grammar (Lark)", "gen(grammar=...)"), ("select", "select")):
        status, detail = rows[name]
        assert status == "refused" and primitive in detail and "llama.cpp" in detail and "llguidance" in detail, detail
    assert rows["gen"][0] == rows["json_schema"][0] == rows["stream"][0] == "works"
    sent_grammars = [ex for ex in transport.pending if "grammar" in (ex["request"] or {})]
    assert len(sent_grammars) == len([ex for ex in exchanges if "grammar" in (ex["request"] or {})])


def test_llamacpp_logprobs_carry_token_ids(hf_folder):
    """llama.cpp answers /v1/completions logprobs in the chat form (``content``, with ids): a
    recorded select answer parses into (logprob, id, text) rows whose ids are the tokens its
    grammar forced."""
    ex = next(ex for ex in RECORDED["llamacpp"]["exchanges"] if "<[" in (ex["request"] or {}).get("grammar", ""))
    forced = [int(t) for t in re.findall(r"<\[(\d+)\]>", ex["request"]["grammar"])]
    ep, _ = _endpoint("llamacpp", hf_folder)
    meta = ep._completion_output(json.loads(ex["response"]), 0.0).meta_info
    assert meta["output_token_ids"] == forced
    assert [t for _, t, _ in meta["output_token_logprobs"]] == forced
    assert all(lp < 0 for lp, _, _ in meta["output_token_logprobs"])
    assert len(meta["output_top_logprobs"]) == len(forced)
    # NOTE: the dialect asks for one top entry when the gen asked for none (llama.cpp sends no
    # logprobs for 0); that unasked entry is dropped.
    unasked = ep._completion_output(json.loads(ex["response"]), 0.0, tops=False).meta_info
    assert "output_top_logprobs" not in unasked and unasked["output_token_ids"] == forced
