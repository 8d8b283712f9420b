"""One typed SamplingParams crosses from the DSL, the servers and the CLI into the backends and
the engine: checked once when built, frozen, one translator per wire format."""
from __future__ import annotations

import dataclasses

import pytest

import sgrt
from sgrt.backends.base import next_token_request, split_stop_regex
from sgrt.errors import InvalidRequest
from sgrt.lang.defaults import gen_sampling_params
from sgrt.sampling_params import WIRE_CORE_FIELDS, SamplingParams


@pytest.mark.parametrize("bad, field", [({"temperature": -1.0}, "temperature"),
                                        ({"seed": 1 << 64}, "seed"),  # past torch's 64-bit generator
                                        ({"temperature": float("inf")}, "temperature"),
                                        ({"top_k": 1 << 40}, "top_k"),
                                        ({"stop_regex": ["("]}, "stop_regex"),
                                        ({"stop_token_ids": [-1]}, "stop_token_ids")])
def test_checked_when_built_by_any_route(bad, field):
    base = SamplingParams()
    for build in (lambda: SamplingParams(**bad), lambda: SamplingParams.from_dict(bad),
                  lambda: base.replace(**bad)):
        with pytest.raises(InvalidRequest) as e:
            build()
        assert e.value.field == field


def test_frozen_and_normalized():
    p = SamplingParams(stop="END", stop_regex=r"\d")
    assert p.stop == ["END"] and p.stop_regex == [r"\d"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = -1.0  # what was checked is what runs


def test_wire_dict_sends_the_core_and_what_was_set():
    wire = SamplingParams(max_tokens=7, jump_forward="text", skip_special_tokens=False).to_wire_dict()
    assert set(WIRE_CORE_FIELDS) <= set(wire)
    assert wire["max_tokens"] == 7 and wire["temperature"] == 0.0
    assert wire["jump_forward"] == "text" and wire["skip_special_tokens"] is False
    assert "no_stop_trim" not in wire and "stop_regex" not in wire and "regex" not in wire


def test_backend_helpers_keep_the_type():
    params, patterns = split_stop_regex({"max_tokens": 4, "stop_regex": ["a+b"]})
    assert isinstance(params, SamplingParams) and params.stop_regex == []
    assert [p.pattern for p in patterns] == ["a+b"]
    probe, rewritten = next_token_request(SamplingParams(max_tokens=0, return_logprob=True, top_logprobs_num=3,
                                                         stop=["x"]))
    assert rewritten and probe.max_tokens == 1 and probe.ignore_eos and probe.stop == []


def test_dsl_translator_merges_gen_run_and_defaults():
    params, dsl = gen_sampling_params({"temperature": 0.5, "max_tokens": 9}, {"max_tokens": 3, "stop": "."},
                                      dtype=int)
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.max_tokens, params.stop) == (0.5, 3, ["."])
    assert params.regex is not None and dsl == {"return_text_in_logprobs": None}
    with pytest.warns(UserWarning, match="temperature"):
        sampled, _ = gen_sampling_params({}, {}, n=2, name="x")
    assert sampled.temperature == 1.0
    with pytest.raises(InvalidRequest) as e:
        gen_sampling_params({}, {"top_p": 2.0})
    assert e.value.field == "top_p"


def test_ws_translator_names_the_sampling_field():
    from sgrt.server.ws import protocol as p
    from sgrt.server.limits import WsLimits
    from sgrt.server.ws.session import ws_sampling_params

    limits = WsLimits()
    params = ws_sampling_params({"temperature": 0.3}, p.Sampling(max_tokens=5), limits, grammar='start: "a"')
    assert (params.temperature, params.max_tokens, params.grammar) == (0.3, 5, 'start: "a"')
    assert ws_sampling_params({}, None, limits).max_tokens == min(limits.default_max_tokens,
                                                                  limits.max_tokens_per_turn)
    with pytest.raises(InvalidRequest) as e:
        ws_sampling_params({}, p.Sampling(top_p=0.0), limits)
    assert e.value.field == "sampling.top_p"
    with pytest.raises(p.LimitExceeded):
        ws_sampling_params({}, p.Sampling(max_tokens=limits.max_tokens_per_turn + 1), limits)


def test_openai_translator_offsets_the_seed_per_choice():
    from sgrt.server.openai import adapter as oa

    fields = {"seed": 10, "temperature": 0.7, "top_logprobs_num": 21}
    with pytest.raises(InvalidRequest) as e:
        oa.build_params(fields, oa.CHAT_FIELD_NAMES)
    assert e.value.field == "top_logprobs"  # the request's own name
    fields["top_logprobs_num"] = 2
    assert [oa.build_params(fields, oa.CHAT_FIELD_NAMES, i).seed for i in range(3)] == [10, 11, 12]
    assert fields["seed"] == 10


def test_a_gen_is_checked_once_from_the_dsl_to_the_engine(runtime, monkeypatch):
    # The DSL builds the gen's params once; the backend and the engine take them as they are
    # (the engine adds only its vocabulary check).
    calls = []
    real = SamplingParams.validate

    def counting(self, vocab_size=None):
        calls.append(vocab_size)
        return real(self, vocab_size)

    monkeypatch.setattr(SamplingParams, "validate", counting)

    @sgrt.function
    def one(s):
        s += "Say hi: " + sgrt.gen("x", max_tokens=2, stop_regex=r"\n")

    state = one.run(backend=runtime)
    assert isinstance(state["x"], str)
    # Built once by the DSL; split_stop_regex's copy without stop_regex is the one other build.
    assert len(calls) == 2 and calls == [None, None]

    @sgrt.function
    def plain(s):
        s += "Say hi: " + sgrt.gen("x", max_tokens=2)

    calls.clear()
    assert isinstance(plain.run(backend=runtime, temperature=0.0)["x"], str)
    assert calls == [None]
