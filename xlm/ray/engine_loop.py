"""EngineLoop: one thread that owns an xlm.LLM's engine and steps it while work is queued.

Ray Data hands a replica several batches at once (`max_concurrent_batches`) from its
asyncio loop. Each batch's rows are queued here; the thread adds every queued row to the
engine before each step and keeps stepping while any request is unfinished, so rows of
the next batch join the running batch the step after they arrive (continuous batching
across batches) and the engine never waits for a whole batch to finish. The engine is
touched by this thread only; a step runs XLA with the GIL released, so the replica's
asyncio loop (Ray's block fetching, the next batch's parsing) keeps running meanwhile.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Any

from xlm.logger import init_logger
from xlm.outputs import RequestOutput
from xlm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class EngineLoop:
    """Feeds requests into an LLMEngine from any thread; futures resolve when they finish."""

    def __init__(self, llm_engine: Any, name: str = "xlm-engine-loop") -> None:
        self.engine = llm_engine
        self._intake: queue.SimpleQueue[tuple[str, Any, SamplingParams, Future] | None] = (
            queue.SimpleQueue()
        )
        self._pending: dict[str, Future] = {}
        self._ids = itertools.count()
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, prompt: Any, params: SamplingParams) -> Future:
        """Queue one request; its Future gets the final RequestOutput or the row's error."""
        future: Future = Future()
        if self.dead_error is not None:
            future.set_exception(self.dead_error)
            return future
        params = params.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        self._intake.put((f"ray-{next(self._ids)}", prompt, params, future))
        if self.dead_error is not None and not future.done():  # died while we queued
            future.set_exception(self.dead_error)
        return future

    def shutdown(self) -> None:
        self._intake.put(None)
        self._thread.join(timeout=10)

    def _admit(self, item: tuple[str, Any, SamplingParams, Future]) -> None:
        request_id, prompt, params, future = item
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as e:  # a rejected row (too long, bad ids...): its error, not ours
            future.set_exception(e)
            return
        self._pending[request_id] = future

    def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    item = self._intake.get()  # idle: sleep until work arrives
                    if item is None:
                        return
                    self._admit(item)
                while True:  # everything queued joins the next step
                    try:
                        item = self._intake.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    self._admit(item)
                if not self.engine.has_unfinished_requests():
                    continue
                for output in self.engine.step():
                    if output.finished:
                        self._finish(output)
        except BaseException as e:  # the engine itself failed: every waiting row learns it
            logger.exception("xlm engine loop died")
            self.dead_error = e
            for future in self._pending.values():
                future.set_exception(e)
            self._pending.clear()
            while True:
                try:
                    item = self._intake.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[3].set_exception(e)

    def _finish(self, output: RequestOutput) -> None:
        future = self._pending.pop(output.request_id, None)
        if future is not None:
            future.set_result(output)
