"""ProcessorConfig: what a Ray Data job of xlm replicas runs, and on what resources."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProcessorConfig:
    """One xlm model served by `replicas` Ray actors over a Ray Dataset.

    `engine_kwargs` are the options of `xlm.LLM(...)` (max_num_seqs, kv_cache_memory,
    tensor_parallel_size, ...). Resources are per replica: a replica that spans a host's
    chips asks for all of them (`num_tpu_chips=4`, or `num_gpus=8` with
    `engine_kwargs={"tensor_parallel_size": 8}`), so Ray places one replica per host.
    """

    model: str = "smollm2-135m"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    replicas: int = 1
    batch_size: int = 64
    # Batches one replica holds at once: the next batch's rows enter the engine while the
    # last one's finish, so the engine does not idle between batches.
    max_concurrent_batches: int = 4
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    num_tpu_chips: int = 0
    accelerator_type: str | None = None
    # Fault tolerance, handed to Ray: a dead replica is restarted up to max_restarts
    # times, and each batch it held is retried (on any replica) up to max_task_retries.
    max_restarts: int = 4
    max_task_retries: int = 4
    # Exceptions raised by a replica on which Ray retries the batch (not row errors:
    # those become error fields). Engine death is the one that a fresh replica cures.
    retry_exceptions: list[type[BaseException]] = field(default_factory=list)
    # Environment variables for the replica processes (XLM_*, JAX_PLATFORMS, ...).
    env_vars: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("replicas", "batch_size", "max_concurrent_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ProcessorConfig.{name}={value!r} is invalid: allowed >= 1")
        for name in ("num_cpus", "num_gpus", "num_tpu_chips"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"ProcessorConfig.{name}={getattr(self, name)!r} is invalid: allowed >= 0"
                )
        for name in ("max_restarts", "max_task_retries"):
            if getattr(self, name) < -1:
                raise ValueError(
                    f"ProcessorConfig.{name}={getattr(self, name)!r} is invalid: allowed >= -1 "
                    "(-1: unlimited)"
                )

    def map_batches_kwargs(self) -> dict[str, Any]:
        """`Dataset.map_batches` options: the actor pool, resources per replica, retries."""
        import ray.data

        kwargs: dict[str, Any] = {
            "compute": ray.data.ActorPoolStrategy(
                size=self.replicas, max_concurrent_calls_per_actor=self.max_concurrent_batches
            ),
            "num_cpus": self.num_cpus,
            # Actor options without a named parameter in map_batches (Ray 2.60 passes them
            # to the actor as they are).
            "max_restarts": self.max_restarts,
            "max_task_retries": self.max_task_retries,
        }
        if self.num_gpus:
            kwargs["num_gpus"] = self.num_gpus
        if self.num_tpu_chips:
            kwargs["resources"] = {"TPU": self.num_tpu_chips}
        if self.accelerator_type:
            kwargs["accelerator_type"] = self.accelerator_type
        if self.env_vars:
            kwargs["runtime_env"] = {"env_vars": dict(self.env_vars)}
        return kwargs
