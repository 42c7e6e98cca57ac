"""The engine's flags: one per EngineArgs field, typed and with their choices."""

import argparse
import dataclasses

import pytest

from xlm.engine.arg_flags import NO_FLAG, add_engine_flags
from xlm.engine.arg_utils import EngineArgs


def _parser(skip=()):
    parser = argparse.ArgumentParser()
    add_engine_flags(parser.add_argument_group("engine"), EngineArgs(), skip)
    return parser


def test_every_field_has_its_flag_but_the_ones_without():
    dests = {a.dest for a in _parser()._actions}
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    # The deprecated start-up aliases get theirs apart; `xlm plan` adds target_topology's.
    assert fields - dests == {"target_topology"} and "target_topology" in NO_FLAG
    assert "max_num_seqs" not in {a.dest for a in _parser(skip=("max_num_seqs",))._actions}


def test_flags_parse_to_the_fields_types():
    args = _parser().parse_args(
        [
            "--max-model-len=64",
            "--kv-cache-memory=0.5",
            "--token-buckets=16,32",
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--no-enable-prefix-caching",
            "-tp=2",
        ]
    )
    assert args.max_model_len == 64 and args.kv_cache_memory == 0.5
    assert args.token_buckets == [16, 32] and args.limit_mm_per_prompt == {"image": 2}
    assert args.enable_prefix_caching is False and args.tensor_parallel_size == 2


def test_a_value_outside_the_choices_is_refused(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-cache-dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
