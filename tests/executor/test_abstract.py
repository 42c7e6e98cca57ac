"""The Executor interface: an engine runs on the local devices only (a target topology is
for `xlm plan`), and an executor must implement the step methods (which executor a config
gets: tests/test_executor.py)."""

from __future__ import annotations

import pytest

from xlm.config import ModelConfig, ParallelConfig, XlmConfig
from xlm.executor.abstract import Executor


class _Local(Executor):
    """The least an executor implements (no worker: nothing here runs a step)."""

    num_blocks = 0

    def execute_model(self, scheduler_output):
        raise NotImplementedError

    def dispatch(self, scheduler_output):
        raise NotImplementedError

    def collect(self):
        raise NotImplementedError

    def shutdown(self):
        pass


def test_a_target_topology_is_refused_naming_xlm_plan():
    config = XlmConfig(
        ModelConfig(model="m"), parallel_config=ParallelConfig(target_topology="v5e:2x2")
    )
    with pytest.raises(ValueError, match=r"target_topology='v5e:2x2' only compiles \(xlm plan"):
        _Local(config)
    local = XlmConfig(ModelConfig(model="m"))
    assert _Local(local).config is local


def test_an_executor_missing_a_step_method_cannot_be_made():
    methods = {k: v for k, v in vars(_Local).items() if k != "collect"}
    no_collect = type("NoCollect", (Executor,), methods)
    with pytest.raises(TypeError, match="collect"):
        no_collect(XlmConfig(ModelConfig(model="m")))
