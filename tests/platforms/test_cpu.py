"""The CPU platform: the host's memory as the device's, and the KV cache size it sets when
none was asked for (XLM_CPU_KVCACHE_SPACE, else its default)."""

from __future__ import annotations

import os
from types import SimpleNamespace

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
