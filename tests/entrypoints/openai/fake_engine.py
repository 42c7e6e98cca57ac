"""A stand-in AsyncLLM for HTTP-layer unit tests (the e2e tests run the real engine)."""

from __future__ import annotations

import asyncio
from typing import Any

from xlm.engine.processor import Processor
from xlm.outputs import CompletionOutput, Logprob, RequestOutput


class FakeAsyncEngine:
    """Generates the prompt's tokens in a cycle, one per step, as DELTA outputs."""

    def __init__(self, tokenizer: Any, max_model_len: int = 64, max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # The real request checks (the server's --max-logprobs reaches the processor).
        self.processor = Processor(tokenizer, max_model_len, max_logprobs=max_logprobs)
        self.errored = False
        self.dead_error = None
        self.ready_info: dict[str, Any] = {}
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.last_params: Any = None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.active)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(
        self,
        prompt: Any,
        params: Any,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ):
        # The handlers hand over the EngineCoreRequest the processor built.
        params = prompt.sampling_params
        self.last_params = params
        ids = prompt.prompt_token_ids
        self.active.add(request_id)
        done = False
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(0)
                last = step == params.max_tokens - 1
                outs = []
                for j in range(params.n):
                    t = ids[(step + j) % len(ids)]
                    lp = None
                    if params.logprobs is not None:
                        lp = [{t: Logprob(-0.5, 1, self.tokenizer.decode([t]))}]
                    outs.append(
                        CompletionOutput(
                            j, self.tokenizer.decode([t]), [t], None, lp, "length" if last else None
                        )
                    )
                done = last
                yield RequestOutput(request_id, None, ids, None, outs, finished=last)
        finally:
            self.active.discard(request_id)
            if not done:
                self.aborted.append(request_id)

    async def abort_all(self) -> list[str]:
        return []

    def do_log_stats(self) -> None:
        pass

    def start_output_handler(self) -> None:
        pass
