"""CompilationConfig: validated token buckets, sorted and deduplicated."""

import pytest

from xlm.config import CompilationConfig


def test_invalid_buckets_name_field_and_value():
    with pytest.raises(ValueError, match=r"token_buckets=\[0, 8\]"):
        CompilationConfig(token_buckets=[0, 8])


def test_buckets_are_sorted_and_deduplicated():
    assert CompilationConfig(token_buckets=[64, 16, 64]).token_buckets == [16, 64]
