"""The speculative options are checked by one function, for a request and for the engine's
default alike (same limits, same field names)."""
from __future__ import annotations

import pytest

from sgrt.engine.sampling_params import SamplingParams, check_speculative
from sgrt.engine.speculative import SpecConfig
from sgrt.errors import InvalidRequest


@pytest.mark.parametrize("bad, field", [({"speculative": "eagle"}, "speculative"),
                                        ({"num_draft_tokens": 0}, "num_draft_tokens"),
                                        ({"num_draft_tokens": 17}, "num_draft_tokens"),
                                        ({"num_draft_tokens": True}, "num_draft_tokens")])
def test_request_and_engine_refuse_the_same_values(bad, field):
    with pytest.raises(InvalidRequest) as on_request:
        SamplingParams(**bad).validate()
    with pytest.raises(InvalidRequest) as on_engine:
        SpecConfig(**bad)
    assert on_request.value.field == on_engine.value.field == field
    assert str(on_request.value) == str(on_engine.value)


def test_draft_without_a_draft_model_names_the_callers_field():
    with pytest.raises(InvalidRequest) as e:
        SpecConfig(speculative="draft")
    assert e.value.field == "draft_model"
    with pytest.raises(InvalidRequest) as e:
        check_speculative("draft", None, has_draft_model=False)
    assert e.value.field == "speculative"
    check_speculative("draft", 16, has_draft_model=True)
    check_speculative("draft", None)  # the request alone: the engine checks the model later
    SamplingParams(speculative="ngram", num_draft_tokens=1).validate()
