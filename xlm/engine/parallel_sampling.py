"""n > 1: a parent request fans out to n child requests whose outputs are merged."""

from __future__ import annotations

import dataclasses

from xlm.engine.messages import EngineCoreRequest
from xlm.outputs import CompletionOutput, RequestMetrics
from xlm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """Tracks the n children of one request and merges their CompletionOutputs."""

    def __init__(self, request_id: str, params: SamplingParams, arrival_time: float) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.unfinished = set(range(self.n))
        # Latest cumulative output per child index (FINAL_ONLY and CUMULATIVE).
        self.latest: dict[int, CompletionOutput] = {}
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    def child_request_id(self, index: int) -> str:
        """The engine-core id of child ``index``."""
        return f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """Child ``index``'s params: n=1 and, when seeded, seed + index (like vLLM)."""
        params = self.params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed += index
        return params

    def child_request_ids(self) -> list[str]:
        """All n child ids, in index order."""
        return [self.child_request_id(i) for i in range(self.n)]

    def add_output(self, completion: CompletionOutput) -> None:
        """Record one child's output of this step."""
        self.latest[completion.index] = completion
        if completion.finished():
            self.unfinished.discard(completion.index)

    @property
    def finished(self) -> bool:
        """Whether every child has finished."""
        return not self.unfinished

    def merged_outputs(self, step_outputs: list[CompletionOutput]) -> list[CompletionOutput]:
        """What this step emits: new deltas (DELTA), all so far (CUMULATIVE), or the end."""
        kind = self.params.output_kind
        if kind == RequestOutputKind.DELTA:
            return sorted(step_outputs, key=lambda c: c.index)
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return []
        return [self.latest[i] for i in sorted(self.latest)]


def fan_out(
    request: EngineCoreRequest,
) -> list[tuple[EngineCoreRequest, ParentRequest | None, int]]:
    """The core requests of one user request: itself, or its n children (n > 1)."""
    params = request.sampling_params
    if params.n == 1:
        return [(request, None, 0)]
    parent = ParentRequest(request.request_id, params, request.arrival_time)
    return [
        (
            dataclasses.replace(
                request,
                request_id=parent.child_request_id(i),
                sampling_params=parent.child_params(i),
            ),
            parent,
            i,
        )
        for i in range(params.n)
    ]
