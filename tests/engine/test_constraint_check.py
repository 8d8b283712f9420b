""""At most one constraint" is one check (sgrt.sampling_params.the_constraint), run when a
SamplingParams is built; the grammar compiler reads the one constraint of a SamplingParams and
runs the same check only for other objects: same message, same field."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgrt.constrained.compiler import _constraint_of
from sgrt.errors import GrammarError, InvalidRequest
from sgrt.sampling_params import SamplingParams, the_constraint


@pytest.mark.parametrize("given, second", [({"regex": "a", "json_schema": {}}, "json_schema"),
                                           ({"regex": "a", "grammar": "start: 'a'"}, "grammar"),
                                           ({"json_schema": {}, "grammar": "start: 'a'"}, "grammar")])
def test_two_constraints_name_the_second_everywhere(given, second):
    with pytest.raises(InvalidRequest) as on_params:
        SamplingParams(**given)  # checked when built
    with pytest.raises(InvalidRequest) as from_dict:
        SamplingParams.from_dict(given)
    with pytest.raises(GrammarError) as in_compiler:
        _constraint_of(SimpleNamespace(**given))  # not a SamplingParams: the compiler checks
    assert on_params.value.field == from_dict.value.field == in_compiler.value.field == second
    assert str(on_params.value) == str(from_dict.value) == str(in_compiler.value)


def test_one_or_none():
    assert the_constraint({"regex": "a+", "grammar": None}) == ("regex", "a+")
    assert the_constraint({}) == (None, None)
    assert _constraint_of(SamplingParams(json_schema={"type": "integer"})) == ("json_schema", {"type": "integer"})
