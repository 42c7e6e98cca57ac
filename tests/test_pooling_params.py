"""PoolingParams validates on construction, naming the parameter and the allowed range."""

from __future__ import annotations

import pytest

from xlm.pooling_params import PoolingParams, PoolingType


def test_defaults_and_names():
    p = PoolingParams()
    assert (p.pooling_type, p.normalize, p.dimensions) == (PoolingType.LAST, True, None)
    assert PoolingParams(pooling_type="Mean").pooling_type is PoolingType.MEAN
    assert PoolingParams(pooling_type="cls").pooling_type is PoolingType.CLS


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pooling_type": "max"}, r"pooling_type='max'.*allowed last, mean, cls"),
        ({"normalize": 1}, r"normalize=1.*True or False"),
        ({"dimensions": 0}, r"dimensions=0.*integer >= 1"),
        ({"dimensions": True}, r"dimensions=True"),
        ({"dimensions": 2.5}, r"dimensions=2.5"),
        ({"task": "score"}, r"task='score'.*allowed embed, classify"),
        ({"activation": None}, r"activation=None.*True or False"),
    ],
)
def test_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


def test_verify_against_hidden_size():
    PoolingParams(dimensions=64).verify(64)
    with pytest.raises(ValueError, match=r"dimensions=65.*1 to 64"):
        PoolingParams(dimensions=65).verify(64)


def test_a_classify_request_takes_no_dimensions():
    p = PoolingParams(task="classify")
    assert p.activation is True
    p.verify(64)
    with pytest.raises(ValueError, match=r"dimensions=8 is invalid with task 'classify'"):
        PoolingParams(task="classify", dimensions=8).verify(64)
