"""LLMReplica: the stateful Ray Data UDF that runs rows through one xlm.LLM.

Ray Data builds one LLMReplica per actor (`map_batches(LLMReplica,
compute=ActorPoolStrategy(size=N))`), so the engine is built, loaded and compiled once per
replica. Rows carry one of `prompt` (text), `messages` (chat messages) or
`prompt_token_ids`, and optionally `sampling_params` (a dict of SamplingParams fields);
every input column is passed through, and the outputs add `generated_text`,
`generated_token_ids`, `finish_reason`, `num_input_tokens`, `num_generated_tokens` and
`error` (null, or why the engine rejected the row).
"""

from __future__ import annotations

import asyncio
import os
import warnings
from typing import Any

from xlm.logger import init_logger

logger = init_logger(__name__)

OUTPUT_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "finish_reason",
    "num_input_tokens",
    "num_generated_tokens",
    "error",
)


def _output_schema() -> Any:
    import pyarrow as pa

    return {
        "generated_text": pa.string(),
        "generated_token_ids": pa.list_(pa.int64()),
        "finish_reason": pa.string(),
        "num_input_tokens": pa.int64(),
        "num_generated_tokens": pa.int64(),
        "error": pa.string(),
    }


def _drop_nulls(value: Any) -> Any:
    """Arrow fills fields a row lacks with nulls; the engine wants them absent."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


class ReplicaContext:
    """Who this replica is (Ray actor id, pid) and its reports to the job's JobStats."""

    def __init__(self, stats: Any) -> None:
        import ray

        context = ray.get_runtime_context()
        self.replica = context.get_actor_id() or f"pid-{os.getpid()}"
        self.stats = stats
        with warnings.catch_warnings():  # Ray's property reads its own deprecated field
            warnings.simplefilter("ignore")
            restarted = bool(context.was_current_actor_reconstructed)
        if stats is not None:
            stats.replica_started.remote(self.replica, os.getpid(), restarted)

    def batch_started(self, rows: int) -> None:
        if self.stats is not None:
            self.stats.batch_started.remote(self.replica, rows)

    def batch_finished(self, rows: int, output_tokens: int) -> None:
        if self.stats is not None:
            self.stats.batch_finished.remote(self.replica, rows, output_tokens)


def die_for_restart(error: BaseException) -> None:
    """The engine is dead: end this process so Ray restarts the replica and retries its
    batches (max_restarts / max_task_retries); an exception would only fail the batch."""
    logger.error("xlm engine died (%s): exiting so Ray restarts this replica", error)
    os._exit(1)


class LLMReplica:
    """One xlm.LLM per Ray actor; `__call__` runs a batch of rows through it."""

    def __init__(
        self,
        model: str,
        engine_kwargs: dict[str, Any],
        default_sampling_params: dict[str, Any] | None = None,
        stats: Any = None,
    ) -> None:
        from xlm.entrypoints.llm import LLM
        from xlm.ray.engine_loop import EngineLoop

        self.context = ReplicaContext(stats)
        self.llm = LLM(model=model, **engine_kwargs)
        self.loop = EngineLoop(self.llm.llm_engine)
        self.default_sampling_params = dict(default_sampling_params or {})

    def _prompt(self, row: dict[str, Any]) -> Any:
        from xlm.tokenizer import apply_chat_template

        given = [k for k in ("prompt", "messages", "prompt_token_ids") if row.get(k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a row needs exactly one of 'prompt', 'messages', 'prompt_token_ids'; got {given}"
            )
        if given[0] == "prompt":
            return row["prompt"]
        if given[0] == "prompt_token_ids":
            return {"prompt_token_ids": [int(t) for t in row["prompt_token_ids"]]}
        messages = _drop_nulls(list(row["messages"]))
        return {"prompt_token_ids": apply_chat_template(self.llm.get_tokenizer(), messages)}

    def _params(self, row: dict[str, Any]) -> Any:
        from xlm.sampling_params import SamplingParams

        fields = {**self.default_sampling_params, **_drop_nulls(row.get("sampling_params") or {})}
        params = SamplingParams(**fields)
        if params.n != 1:
            raise ValueError(f"sampling_params.n={params.n} is invalid in a batch row: allowed 1")
        return params

    async def _one(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            future = self.loop.submit(self._prompt(row), self._params(row))
            output = await asyncio.wrap_future(future)
        except Exception as e:
            if self.loop.dead_error is not None:
                raise
            return {"error": f"{type(e).__name__}: {e}"}
        completion = output.outputs[0]
        return {
            "generated_text": completion.text,
            "generated_token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "num_input_tokens": len(output.prompt_token_ids or []),
            "num_generated_tokens": len(completion.token_ids),
            "error": None,
        }

    async def __call__(self, batch: Any) -> Any:
        """A pyarrow Table of rows in; the same table with the output columns added."""
        import pyarrow as pa

        rows = batch.to_pylist()
        self.context.batch_started(len(rows))
        try:
            results = await asyncio.gather(*(self._one(r) for r in rows))
        except Exception as e:
            die_for_restart(e)
            raise
        schema = _output_schema()
        for name in OUTPUT_COLUMNS:
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(
                pa.field(name, schema[name]),
                pa.array([r.get(name) for r in results], type=schema[name]),
            )
        self.context.batch_finished(
            len(rows), sum(r.get("num_generated_tokens") or 0 for r in results)
        )
        return batch

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()
