"""ProcessorConfig validation (no Ray cluster)."""

from __future__ import annotations

import pytest

from xlm.ray import ProcessorConfig


@pytest.mark.parametrize(
    "field, value", [("replicas", 0), ("batch_size", -1), ("num_gpus", -1), ("max_restarts", -2)]
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"ProcessorConfig.{field}={value}"):
        ProcessorConfig(**{field: value})
