"""SpeculativeConfig: bad values name the parameter; from a dict or JSON text; the sampler
rows a speculating step needs."""

import pytest

from xlm.config import SpeculativeConfig


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle"}, "SpeculativeConfig.method='eagle' is invalid"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid"),
        ({"num_speculative_tokens": 17}, "an integer from 1 to 16"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5 is invalid"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size=0 is invalid"),
        ({"method": "draft_model"}, "SpeculativeConfig.model=None is invalid"),
        ({"model": "x"}, "SpeculativeConfig.model='x' is invalid"),
        ({"adaptive": "no"}, "SpeculativeConfig.adaptive='no' is invalid"),
        ({"num_tokens": 3}, "unknown keys ['num_tokens']"),
        ("{not json", "not JSON"),
        (3, "speculative_config=3 is invalid"),
    ],
)
def test_bad_speculative_configs_name_the_parameter(value, message):
    with pytest.raises(ValueError, match=None) as e:
        SpeculativeConfig.from_dict(value)
    assert message in str(e.value)


def test_speculative_config_from_json_and_rows():
    config = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.num_speculative_tokens == 3 and config.disable_by_batch_size == 8
    # At most 8 requests verify 3 + 1 rows each; a 64-request step keeps one row each.
    assert config.rows_needed(64) == 64 and config.rows_needed(4) == 16
    assert SpeculativeConfig(disable_by_batch_size=None).rows_needed(64) == 64 * 4
