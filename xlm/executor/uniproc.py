"""Executor for one process driving all local devices."""

from __future__ import annotations

from xlm.config import XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.executor.abstract import Executor
from xlm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Runs the one worker in this process; it drives all local devices."""

    def __init__(self, config: XlmConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.warmup()

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def dispatch(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.dispatch(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        return self.worker.collect()

    def shutdown(self) -> None:
        """Stop background compilation (the worker's arrays go with this process)."""
        self.worker.model_runner.shutdown()
