"""Worker KV-cache sizing on a platform whose backend reports no memory statistics."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from xlm import platforms
from xlm.engine.arg_utils import EngineArgs
from xlm.platforms.interface import Platform, PlatformEnum
from xlm.worker.worker import Worker, kv_cache_bytes_per_block


class NoMemoryStatsPlatform(Platform):
    """An out-of-tree platform on the CPU backend, which reports no memory statistics."""

    _enum = PlatformEnum.OOT
    device_name = "no-stats"
    device_type = "cpu"
    jax_platform = "cpu"
    supports_fast_bf16 = False


@pytest.mark.parametrize("kv_cache_memory", [None, 0.01])
def test_kv_sizing_without_memory_statistics(
    tiny_checkpoint, monkeypatch, on_platform, kv_cache_memory
):
    on_platform(NoMemoryStatsPlatform)
    assert platforms.current_platform.get_device_free_memory() is None
    monkeypatch.delenv("XLM_CPU_KVCACHE_SPACE", raising=False)
    config = EngineArgs(
        model=tiny_checkpoint("llama"), max_model_len=64, startup_programs="used"
    ).create_config()
    # The out-of-tree platform's check_and_update_config sets no size, unlike the CPU one.
    config.cache_config.kv_cache_memory = kv_cache_memory
    worker = Worker(config)
    gib = 1.0 if kv_cache_memory is None else kv_cache_memory  # the documented default
    per_block = kv_cache_bytes_per_block(
        worker.model, config.cache_config.block_size, jnp.dtype(worker.kv_dtype)
    )
    assert worker.num_blocks == int(gib * (1 << 30) // per_block)
    assert config.cache_config.num_blocks == worker.num_blocks
