"""Processor: a Ray Dataset -> Dataset transform running xlm replicas, in ray.data.llm's shape.

processor = build_llm_processor(
    ProcessorConfig(model="smollm2-135m", replicas=4, batch_size=64),
    preprocess=lambda row: {"prompt": row["question"], "sampling_params": {"max_tokens": 64}},
    postprocess=lambda row: {"question": row["question"], "answer": row["generated_text"]},
)
processor(ray.data.read_parquet("s3://bucket/questions/")).write_parquet("s3://bucket/out/")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xlm.ray.config import ProcessorConfig
from xlm.ray.replica import LLMReplica
from xlm.ray.stats import JobStats, summarize

Row = dict[str, Any]


def configure_retries(config: ProcessorConfig) -> None:
    """Tell Ray Data which replica exceptions retry a batch (it reads this at execution)."""
    import ray.data

    if config.retry_exceptions:
        ray.data.DataContext.get_current().actor_task_retry_on_errors = list(
            config.retry_exceptions
        )


def start_job_stats() -> Any:
    """The JobStats actor replicas report to (no CPU of its own; it lives with the driver)."""
    import ray

    return ray.remote(num_cpus=0)(JobStats).remote()


def split_into_batches(dataset: Any, batch_size: int) -> Any:
    """Blocks of one batch each: Ray hands a replica whole blocks, so a file read as one
    block would otherwise go to one replica. Streaming, and it keeps the row order."""
    return dataset.repartition(target_num_rows_per_block=batch_size)


def map_replicas(
    dataset: Any, replica_cls: type, config: ProcessorConfig, kwargs: dict[str, Any]
) -> Any:
    """`dataset` split into batches and mapped through `config.replicas` actors of
    `replica_cls(**kwargs)`, with the config's resources and Ray's retries."""
    import warnings

    with warnings.catch_warnings():
        # max_restarts / max_task_retries have no named parameter in map_batches yet; Ray
        # 2.60 warns about passing them through but passes them.
        warnings.filterwarnings("ignore", message=".*ray_remote_args. is deprecated")
        return split_into_batches(dataset, config.batch_size).map_batches(
            replica_cls,
            batch_size=config.batch_size,
            batch_format="pyarrow",
            fn_constructor_kwargs=kwargs,
            **config.map_batches_kwargs(),
        )


class Processor:
    """preprocess -> xlm replicas (map_batches over an actor pool) -> postprocess."""

    def __init__(
        self,
        config: ProcessorConfig,
        preprocess: Callable[[Row], Row] | None = None,
        postprocess: Callable[[Row], Row] | None = None,
        sampling_params: dict[str, Any] | None = None,
        replica_cls: type | None = None,
    ) -> None:
        self.config = config
        self.replica_cls = replica_cls
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.sampling_params = dict(sampling_params or {})
        self.job_stats: Any = None

    def __call__(self, dataset: Any) -> Any:
        """The lazy Dataset of outputs (Ray runs it when it is consumed or written)."""
        config = self.config
        configure_retries(config)
        if self.job_stats is None:
            self.job_stats = start_job_stats()
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess)
        dataset = map_replicas(
            dataset,
            self.replica_cls or LLMReplica,
            config,
            {
                "model": config.model,
                "engine_kwargs": dict(config.engine_kwargs),
                "default_sampling_params": self.sampling_params,
                "stats": self.job_stats,
            },
        )
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess)
        return dataset

    def stats(self, rows_out: int, elapsed: float) -> dict[str, Any]:
        """Closing figures for a run of `rows_out` rows that took `elapsed` seconds."""
        import ray

        snapshot = ray.get(self.job_stats.snapshot.remote()) if self.job_stats else {}
        return summarize(snapshot, rows_out, elapsed)


def build_llm_processor(
    config: ProcessorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
    sampling_params: dict[str, Any] | None = None,
    replica_cls: type | None = None,
) -> Processor:
    """A Processor for `config`; `sampling_params` are defaults a row's own override;
    `replica_cls` a subclass of LLMReplica to change how a row is run."""
    return Processor(config, preprocess, postprocess, sampling_params, replica_cls)
