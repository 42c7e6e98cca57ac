"""The CPU platform: the host's memory as the device's, and the KV cache size it sets when
none was asked for (XLM_CPU_KVCACHE_SPACE, else its default)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from xlm.platforms.cpu import DEFAULT_CPU_KV_CACHE_GIB, CpuPlatform


def config_with(kv_cache_memory):
    return SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory=kv_cache_memory))


def test_total_memory_is_the_hosts():
    expected = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert CpuPlatform().get_device_total_memory() == expected > 0


def test_kv_cache_size_default_env_and_explicit(monkeypatch):
    monkeypatch.delenv("XLM_CPU_KVCACHE_SPACE", raising=False)
    config = config_with(None)
    CpuPlatform().check_and_update_config(config)
    assert config.cache_config.kv_cache_memory == DEFAULT_CPU_KV_CACHE_GIB
    monkeypatch.setenv("XLM_CPU_KVCACHE_SPACE", "0.25")
    config = config_with(None)
    CpuPlatform().check_and_update_config(config)
    assert config.cache_config.kv_cache_memory == 0.25
    config = config_with(2.0)  # asked for: kept
    CpuPlatform().check_and_update_config(config)
    assert config.cache_config.kv_cache_memory == 2.0
    assert not CpuPlatform.supports_fast_bf16


def test_a_data_parallel_rank_gets_tp_devices_and_its_share_of_the_cores(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8")
    env = CpuPlatform().data_parallel_env(rank=1, tp=2)
    assert env == {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"}
    monkeypatch.delenv("XLA_FLAGS")
    assert CpuPlatform().data_parallel_env(0, 3) == {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=3"
    }
    cpus = sorted(os.sched_getaffinity(0))
    shares = [CpuPlatform().data_parallel_cpus(r, 2) for r in range(2)]
    if len(cpus) >= 2:
        half = len(cpus) // 2
        assert shares == [set(cpus[:half]), set(cpus[half : 2 * half])]
    assert CpuPlatform().data_parallel_cpus(0, len(cpus) + 1) is None  # more ranks than cores


def test_a_data_parallel_rank_on_cuda_sees_its_gpus_only(monkeypatch):
    from xlm.platforms.cuda import CudaPlatform

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert CudaPlatform().data_parallel_env(1, 2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert CudaPlatform().data_parallel_env(1, 2) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(ValueError, match="data-parallel rank 2 needs GPUs 4..5; 4 visible"):
        CudaPlatform().data_parallel_env(2, 2)
