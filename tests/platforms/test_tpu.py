"""The TPU platform's config rule, checked without a TPU: pages of at least 16 rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xlm.platforms.tpu import TpuPlatform


@pytest.mark.parametrize(("asked", "used"), [(4, 16), (8, 16), (16, 16), (64, 64)])
def test_small_blocks_are_raised_to_16(asked, used):
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=asked))
    TpuPlatform().check_and_update_config(config)
    assert config.cache_config.block_size == used
    assert TpuPlatform().is_tpu() and not TpuPlatform().is_cpu()
