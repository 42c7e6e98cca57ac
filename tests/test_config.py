"""Config validation: errors name the field, the value and what is allowed."""

import pytest

from xlm import envs
from xlm.config import (
    CacheConfig,
    CompilationConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    XlmConfig,
)
from xlm.engine.arg_utils import EngineArgs
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
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size=0"),
        (lambda: ParallelConfig(num_processes=2, process_id=2), r"process_id=2.*\[0, 2\)"),
        (lambda: ParallelConfig(coordinator_address="nohost"), "coordinator_address='nohost'"),
        (lambda: ParallelConfig(num_processes=2), "num_processes=2.*multihost"),
        (lambda: ParallelConfig(data_parallel_rank=1), r"data_parallel_rank=1.*\[0, 1\)"),
        (
            lambda: ParallelConfig(data_parallel_size=2, executor_backend="multihost"),
            "data_parallel_size=2.*'uni' engines",
        ),
        (
            lambda: EngineArgs(
                data_parallel_size=2, data_parallel_size_local=1
            ).create_parallel_config(),
            "data_parallel_address=None.*front end host's address",
        ),
        (
            lambda: ParallelConfig(
                data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="h"
            ),
            "data_parallel_rpc_port=None",
        ),
        (
            lambda: ParallelConfig(data_parallel_size=2, data_parallel_size_local=3),
            r"data_parallel_size_local=3.*\[1, 2\]",
        ),
        (
            lambda: ParallelConfig(
                data_parallel_size=3, data_parallel_size_local=2, data_parallel_start_rank=2
            ),
            r"data_parallel_start_rank=2.*\[0, 1\]",
        ),
        (lambda: CompilationConfig(token_buckets=[0, 8]), r"token_buckets=\[0, 8\]"),
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


def test_buckets_are_sorted_and_deduplicated():
    assert CompilationConfig(token_buckets=[64, 16, 64]).token_buckets == [16, 64]


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


def test_tensor_parallel_size_beyond_the_devices_names_both():
    from xlm.distributed.mesh import make_mesh

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*1 device"):
        make_mesh(ParallelConfig(tensor_parallel_size=2))


def test_startup_programs_is_the_one_start_up_option(capsys):
    import argparse

    from xlm.engine.arg_utils import EngineArgs

    assert not hasattr(CompilationConfig(), "warmup")
    assert EngineArgs(startup_programs="used").startup_programs == "used"
    for old, mode in (({"compile_all_first": True}, "all"), ({"warmup": False}, "used")):
        with pytest.warns(DeprecationWarning, match="startup_programs"):
            args = EngineArgs(**old)
        assert args.startup_programs == mode
    with pytest.warns(DeprecationWarning, match="does nothing"):
        assert EngineArgs(warmup=True).startup_programs is None
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    new = EngineArgs.from_cli_args(parser.parse_args(["--startup-programs", "first-use"]))
    assert new.startup_programs == "first-use"
    with pytest.warns(DeprecationWarning):
        old = EngineArgs.from_cli_args(parser.parse_args(["--compile-all-first"]))
    assert old.startup_programs == "all"
    with pytest.warns(DeprecationWarning):
        old = EngineArgs.from_cli_args(parser.parse_args(["--no-warmup"]))
    assert old.startup_programs == "used"
    with pytest.raises(SystemExit):
        parser.parse_args(["--startup-programs", "some"])
    assert "invalid choice" in capsys.readouterr().err


def test_engine_args_defaults_are_the_configs():
    from xlm.engine.arg_utils import EngineArgs

    args = EngineArgs()
    assert args.max_num_seqs == SchedulerConfig().max_num_seqs
    assert args.memory_utilization == CacheConfig().memory_utilization


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
