"""StructuredOutputsParams validation, serialization and grammar validation (no engine)."""

from __future__ import annotations

import pytest

from xlm import SamplingParams, StructuredOutputsParams
from xlm.engine.serial import MsgpackDecoder, MsgpackEncoder
from xlm.structured_output.backend import validate


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(json="{not json"), "json"),
        (dict(json=3), "json"),
        (dict(regex=""), "regex"),
        (dict(choice=[]), "choice"),
        (dict(choice="abc"), "choice"),
        (dict(choice=["a", 1]), "choice"),
        (dict(grammar=""), "grammar"),
        (dict(json_object="yes"), "json_object"),
    ],
)
def test_invalid_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=rf"StructuredOutputsParams\.{field}="):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "params, field",
    [
        (StructuredOutputsParams(regex="[a-"), "regex"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
    ],
)
def test_grammar_errors_name_the_field(params, field):
    with pytest.raises(ValueError, match=rf"StructuredOutputsParams\.{field} is invalid"):
        validate(params)


def test_valid_specs_validate():
    for params in (
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(json='{"type": "array", "items": {"type": "string"}}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[0-9]{3}"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='start: "a" | "b"'),
    ):
        validate(params)


def test_cache_key_equal_for_equal_specs():
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json='{"required": ["x"], "type": "object"}')
    c = StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=True)
    assert a.cache_key() == b.cache_key() != c.cache_key()


def test_sampling_params_round_trip_through_the_wire():
    params = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object"})
    )
    decoded = MsgpackDecoder().decode(MsgpackEncoder().encode(params))
    assert decoded.structured_outputs == params.structured_outputs
    assert (
        SamplingParams.from_dict(params.to_dict()).structured_outputs == params.structured_outputs
    )
    # A plain dict (vLLM's request JSON) is accepted too; a wrong type is named.
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="a+")
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a+"})
