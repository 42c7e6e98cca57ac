"""The runner of a pooling model: its step programs are the model (no LM head) and the
pooler, one vector per request whose prompt the step completes (no sampler, no prompt
logprobs, no speculation)."""

from __future__ import annotations

from typing import Any

import numpy as np

from xlm.core.outputs import ModelRunnerOutput
from xlm.distributed.mesh import to_host
from xlm.worker import pooler
from xlm.worker.compilation import ProgramKey, ProgramKind, ProgramSpec
from xlm.worker.model_runner import ModelRunner
from xlm.worker.packing import pack
from xlm.worker.step_inputs import StepInputs
from xlm.worker.step_outputs import StepInFlight


class PoolingModelRunner(ModelRunner):
    """A ModelRunner whose steps end in the pooler instead of the sampler."""

    def _launch(
        self, req_ids: list[str], num_scheduled: list[int], step: StepInputs
    ) -> StepInFlight:
        bucket = step.shape.num_tokens
        _, hidden = self._run_model(bucket, step.arrays)
        rows = self._pooling_rows(req_ids, step.arrays["attn"].query_start_loc)
        packed, layout = pack(rows)
        args = (hidden, self._step_input(packed))
        program = self.program_store.get(
            self._key(ProgramKind.POOLER, bucket),
            lambda: self.programs.pooler_spec(*args, layout),
            layout,
        )
        self.input_batch.advance(req_ids, num_scheduled)
        self._prev_rows = {}
        return StepInFlight(req_ids, step.has_output, pooled=program(*args), bucket=bucket)

    def _outputs(self, step: StepInFlight) -> ModelRunnerOutput:
        """The vectors of the requests whose prompts this step completed."""
        vectors = np.asarray(to_host(step.pooled))
        states = self.input_batch.requests
        pooled: list[Any] = []
        for i, req_id in enumerate(step.req_ids):
            state = states.get(req_id)
            if not step.has_output[i] or state is None:
                pooled.append(None)
                continue
            pooled.append(pooler.finish_vector(vectors[i].copy(), state.pooling_params))
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=[[] for _ in step.req_ids],
            pooler_output=pooled,
        )

    def _pooling_rows(
        self, req_ids: list[str], query_start_loc: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The pooler's per-row inputs: the step's spans and each request's pooling."""
        states = self.input_batch.requests
        params = [states[r].pooling_params for r in req_ids]
        rows = pooler.pooling_metadata(params, len(query_start_loc) - 1, self.hidden_size)
        return {"query_start_loc": query_start_loc, **rows}

    def _bucket_specs(
        self, bucket: int, arrays: dict[str, Any], model_spec: ProgramSpec
    ) -> dict[ProgramKey, ProgramSpec]:
        """The bucket's pooler, over the hidden states its model program makes."""
        rows = self._pooling_rows([], arrays["attn"].query_start_loc)
        return self.programs.pooler_specs(bucket, rows, model_spec)

    def _other_specs(self) -> dict[ProgramKey, ProgramSpec]:
        return {}  # the pooler replaces the sampler and prompt logprobs

    def _bucket_keys(self, bucket: int) -> list[ProgramKey]:
        return [self._key(ProgramKind.MODEL, bucket), self._key(ProgramKind.POOLER, bucket)]
