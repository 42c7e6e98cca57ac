"""Executor for one process driving all local devices."""

from __future__ import annotations

from xlm.config import XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.worker.worker import Worker


class UniProcExecutor:
    """Runs the worker in this process."""

    def __init__(self, config: XlmConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        if config.compilation_config.warmup:
            self.worker.warmup()

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    @property
    def model_runner(self):
        return self.worker.model_runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
