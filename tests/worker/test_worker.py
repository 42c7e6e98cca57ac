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


class FixedMemoryPlatform(NoMemoryStatsPlatform):
    """The CPU backend reporting a fixed 64 MiB device, 8 MiB of it in use."""

    device_name = "fixed-memory"

    def get_device_memory_stats(self, device_id: int = 0) -> dict:
        return {"bytes_limit": 64 << 20, "bytes_in_use": 8 << 20}


def test_kv_cache_is_sized_after_the_encoder_cache(
    tiny_checkpoint, tiny_llava, monkeypatch, on_platform
):
    """From device memory, the KV cache gets what is left after the encoder cache's pool:
    the tiny LLaVA (its text model the tiny Llama's, same K/V per block) gets the pool's
    worth of blocks fewer than the tiny Llama at the same memory figures."""
    on_platform(FixedMemoryPlatform)
    workers = {}
    for name, model in (("text", tiny_checkpoint("llama")), ("llava", tiny_llava)):
        args = EngineArgs(
            model=model, max_model_len=128, max_num_batched_tokens=64, startup_programs="used"
        )
        config = args.create_config()
        config.cache_config.kv_cache_memory = None
        workers[name] = Worker(config)
    text, llava = workers["text"], workers["llava"]
    block_size = llava.config.cache_config.block_size
    per_block = kv_cache_bytes_per_block(llava.model, block_size, jnp.dtype(llava.kv_dtype))
    assert per_block == kv_cache_bytes_per_block(text.model, block_size, jnp.dtype(text.kv_dtype))
    pool = llava.model_runner.encoder.pool  # the pool the runner allocated
    pool_bytes = pool.size * pool.dtype.itemsize
    assert llava.encoder_cache_bytes() == pool_bytes and text.encoder_cache_bytes() == 0
    drop = text.num_blocks - llava.num_blocks
    assert pool_bytes // per_block <= drop <= pool_bytes // per_block + 1
    assert drop > 0
