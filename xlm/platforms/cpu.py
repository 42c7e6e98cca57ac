"""CPU platform: XLA's CPU backend, float32 by default, a configured KV cache size."""

from __future__ import annotations

import os
import re
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
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def check_and_update_config(self, config: XlmConfig) -> None:
        cache = config.cache_config
        if cache.kv_cache_memory is None:
            cache.kv_cache_memory = envs.XLM_CPU_KVCACHE_SPACE or DEFAULT_CPU_KV_CACHE_GIB

    def data_parallel_env(self, rank: int, tp: int) -> dict[str, str]:
        """A rank's process gets `tp` CPU devices of its own: XLA_FLAGS with the fake host
        device count replaced by tp (the other flags kept)."""
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", envs.xla_flags())
        return {"XLA_FLAGS": f"{flags.strip()} --xla_force_host_platform_device_count={tp}".strip()}

    def data_parallel_cpus(self, rank: int, dp: int) -> set[int] | None:
        """Rank r of dp takes the r-th of dp equal shares of the cores this process may use,
        so ranks do not contend for cores (None when there are fewer cores than ranks)."""
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // dp
        if share == 0:
            return None
        return set(cpus[rank * share : (rank + 1) * share])
