"""The executor interface: how the engine core runs a step on its devices.

Why a layer between EngineCore and the worker: the core schedules once per step for the
whole engine, while the devices that run the step may span one process (all local
devices of one host: `UniProcExecutor`) or several (one process per host of a pod with
`jax.distributed`, which issue #12 adds as a multi-host executor: process 0 schedules
and broadcasts each step to the others). The core sees only this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from xlm.config import XlmConfig
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.lora.request import LoRARequest

if TYPE_CHECKING:
    from xlm.worker.worker import Worker


class Executor(ABC):
    """Runs scheduled steps on the engine's workers; sizes the KV cache at start."""

    def __init__(self, config: XlmConfig) -> None:
        target = config.parallel_config.target_topology
        if target is not None:
            raise ValueError(
                f"target_topology={target!r} only compiles (xlm plan MODEL --target-topology "
                f"{target}); an engine runs on the local devices: leave it unset"
            )
        self.config = config

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """KV cache blocks the workers allocated (the scheduler's block pool size)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the sampled tokens."""

    @abstractmethod
    def dispatch(self, scheduler_output: SchedulerOutput) -> None:
        """Launch one scheduled step without waiting for it (async scheduling)."""

    @abstractmethod
    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest dispatched step and return its sampled tokens."""

    # This process's worker (every executor drives one here; others may mirror it).
    worker: Worker

    def get_num_compilations(self) -> int:
        """Step programs compiled or loaded so far (flat once all are ready)."""
        return self.worker.model_runner.num_compilations

    def programs_ready(self) -> tuple[int, int]:
        """(ready, registered) step programs: the rest compile in the background."""
        return self.worker.model_runner.readiness.programs_ready()

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation; whether every program is ready."""
        return self.worker.model_runner.readiness.wait(timeout)

    # LoRA adapters: this process's worker reads and checks them (a multihost follower
    # reads each from its directory when a step first needs it).
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.worker.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.worker.remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        return self.worker.list_loras()

    # Sleep mode and weight updates: every process's worker does the same (a multihost
    # executor mirrors these calls to its followers).
    def sleep(self, level: int) -> dict[str, int]:
        """Free the workers' weights (level 1: to host memory) and KV caches."""
        return self.worker.sleep(level)

    def wake_up(self) -> None:
        self.worker.wake_up()

    def update_weights(self, path: str) -> None:
        """Load new weights of the same shapes and dtypes (ValueError when they differ)."""
        self.worker.update_weights(path)

    def device_bytes(self) -> dict[str, int]:
        """Weights and KV cache bytes on this process's devices now."""
        return self.worker.device_bytes()

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers."""
