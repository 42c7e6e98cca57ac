"""Config validation: errors name the field, the value and what is allowed."""

import pytest

from xlm import envs
from xlm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    XlmConfig,
)
from xlm.platforms.cpu import CpuPlatform


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: ModelConfig(model=""), "ModelConfig.model=''"),
        (lambda: ModelConfig(model="m", dtype="float8"), "ModelConfig.dtype='float8'.*bfloat16"),
        (lambda: ModelConfig(model="m", max_model_len=0), "max_model_len=0.*positive integer"),
        (lambda: ModelConfig(model="m", load_format="pt"), "load_format='pt'.*gguf"),
        (lambda: ModelConfig(model="m", quantization="int3"), "quantization='int3'.*w8a8"),
        (lambda: CacheConfig(block_size=12), "block_size=12.*power of two"),
        (lambda: CacheConfig(memory_utilization=1.5), r"memory_utilization=1.5.*\(0, 1\]"),
        (lambda: CacheConfig(kv_cache_memory=-1), "kv_cache_memory=-1"),
        (lambda: CacheConfig(num_blocks=1), "num_blocks=1.*>= 2"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs=0"),
        (lambda: SchedulerConfig(policy="lifo"), "policy='lifo'"),
        (
            lambda: SchedulerConfig(
                enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024
            ),
            "max_num_batched_tokens=512.*1024",
        ),
    ],
)
def test_invalid_values_name_field_and_value(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_set_max_model_len_propagates():
    config = XlmConfig(
        ModelConfig(model="m"),
        scheduler_config=SchedulerConfig(
            enable_chunked_prefill=False, max_num_batched_tokens=4096, max_model_len=4096
        ),
    )
    config.set_max_model_len(8192)
    assert config.model_config.max_model_len == 8192
    assert config.scheduler_config.max_model_len == 8192
    assert config.scheduler_config.max_num_batched_tokens == 8192


def test_cpu_platform_sets_kv_cache_memory_from_env(monkeypatch):
    monkeypatch.setenv("XLM_CPU_KVCACHE_SPACE", "2.5")
    config = XlmConfig(ModelConfig(model="m"))
    CpuPlatform().check_and_update_config(config)
    assert config.cache_config.kv_cache_memory == 2.5
    explicit = XlmConfig(ModelConfig(model="m"), cache_config=CacheConfig(kv_cache_memory=0.5))
    CpuPlatform().check_and_update_config(explicit)
    assert explicit.cache_config.kv_cache_memory == 0.5


def test_envs_read_at_access_time(monkeypatch):
    monkeypatch.setenv("XLM_PLUGINS", "a,b")
    assert envs.XLM_PLUGINS == ["a", "b"]
    monkeypatch.setenv("XLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="XLM_CPU_KVCACHE_SPACE='lots'"):
        _ = envs.XLM_CPU_KVCACHE_SPACE
    with pytest.raises(AttributeError):
        _ = envs.XLM_NOT_A_VARIABLE


@pytest.mark.parametrize(
    "field, value",
    [
        ("limit_mm_per_prompt", {"video": 1}),
        ("limit_mm_per_prompt", {"image": -1}),
        ("limit_mm_per_prompt", "4"),
        ("max_image_pixels", 0),
    ],
)
def test_image_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
        ModelConfig(model="m", **{field: value})
    assert ModelConfig(model="m", limit_mm_per_prompt={"image": 0}).limit_mm_per_prompt == {
        "image": 0
    }
