"""EngineArgs: the start-up option and its deprecated aliases, defaults shared with the
configs, and the checks done while building the config."""

import pytest

from xlm.config import CacheConfig, CompilationConfig, SchedulerConfig
from xlm.engine.arg_utils import EngineArgs


def test_startup_programs_is_the_one_start_up_option(capsys):
    import argparse

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

    args = EngineArgs()
    assert args.max_num_seqs == SchedulerConfig().max_num_seqs
    assert args.memory_utilization == CacheConfig().memory_utilization
