"""CPU platform: XLA's CPU backend, float32 by default, a configured KV cache size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xlm import envs
from xlm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from xlm.config import XlmConfig

DEFAULT_CPU_KV_CACHE_GIB = 1.0


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    jax_platform = "cpu"
    # CPUs without bf16 instructions run bfloat16 10-45x slower than float32.
    supports_fast_bf16 = False

    def get_device_total_memory(self, device_id: int = 0) -> int | None:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def check_and_update_config(self, config: XlmConfig) -> None:
        cache = config.cache_config
        if cache.kv_cache_memory is None:
            cache.kv_cache_memory = envs.XLM_CPU_KVCACHE_SPACE or DEFAULT_CPU_KV_CACHE_GIB
