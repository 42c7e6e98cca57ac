"""The engine front end's errors: a validation error keeps the parameter its message names."""

from __future__ import annotations

import pytest

from xlm.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    RequestAbortedError,
    RequestValidationError,
    param_of,
)
from xlm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("SamplingParams.top_p=0 is invalid", "top_p"),
        ("SamplingParams.stop[2] is empty", "stop"),
        ("PoolingParams.dimensions must be positive", "dimensions"),
        ("the prompt is too long", None),
    ],
)
def test_param_of_names_the_field(message, param):
    assert param_of(message) == param


def test_from_value_error_carries_a_real_sampling_params_error():
    with pytest.raises(ValueError) as caught:
        SamplingParams(top_p=0.0)
    error = RequestValidationError.from_value_error(caught.value)
    assert isinstance(error, ValueError) and error.param == "top_p"
    assert str(error) == str(caught.value)
    # An error that already is one passes through unchanged.
    named = RequestValidationError("bad", param="n", code="invalid_n")
    assert RequestValidationError.from_value_error(named) is named
    assert (named.param, named.code) == ("n", "invalid_n")


def test_engine_errors():
    assert str(EngineDeadError()) == "the engine core process is dead"
    assert str(EngineDeadError("gone")) == "gone"
    assert issubclass(RequestAbortedError, EngineGenerateError)
    assert not issubclass(EngineGenerateError, EngineDeadError)
