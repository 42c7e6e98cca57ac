"""A stand-in engine core (an EngineCore subclass without a model), for transport tests.

`FakeEngineCoreProc` is the real `EngineCoreProc` (sockets, threads, busy loop) over
`FakeEngineCore`, which overrides the core's methods to emit last-token+1 each step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlm.core.outputs import EngineCoreOutput, SchedulerStats
from xlm.engine.core import EngineCore
from xlm.engine.core_proc import EngineCoreProc
from xlm.engine.messages import EngineCoreOutputs
from xlm.engine.serial import register_wire_class


@register_wire_class
@dataclass
class FakeRequest:
    """The fields of an EngineCoreRequest the fake core reads."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 4
    logprobs: bool = False
    # What the data-parallel router hashes a prompt's blocks with.
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: Any = None


class FakeEngineCore(EngineCore):
    """Emits last-token+1 each step; a prompt starting with -1 makes step() raise.

    Its config is a dict: {"fail_start": bool, "start_sleep": seconds, "step_sleep": seconds,
    "started_file": a path created when its construction begins}.
    """

    def __init__(self, config: Any, log_stats: bool = True, executor_class: Any = None) -> None:
        if config.get("fail_start"):
            raise RuntimeError("boom at start")
        if config.get("started_file"):
            open(config["started_file"], "w").close()
        time.sleep(config.get("start_sleep", 0.0))
        self.step_sleep = config.get("step_sleep", 0.0)
        self.requests: dict[str, tuple[FakeRequest, list[int]]] = {}

    def make_stats(self) -> SchedulerStats:
        n = len(self.requests)
        return SchedulerStats(num_running_reqs=n, kv_cache_usage=n / 10)

    def is_request_waiting(self, request_id: str) -> bool:
        return False

    def get_ready_info(self) -> dict[str, Any]:
        return {"max_model_len": 128, "engine_pid": os.getpid()}

    def add_request(self, request: Any) -> None:
        if not hasattr(request, "max_tokens"):  # a real EngineCoreRequest
            request = FakeRequest(
                request.request_id, request.prompt_token_ids, request.sampling_params.max_tokens
            )
        if len(request.prompt_token_ids) > 100:
            raise ValueError(f"prompt of {len(request.prompt_token_ids)} tokens never fits")
        self.requests[request.request_id] = (request, [])

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> EngineCoreOutputs:
        if self.step_sleep:
            time.sleep(self.step_sleep)
        outputs = []
        for request_id, (request, generated) in list(self.requests.items()):
            if request.prompt_token_ids[0] == -1:
                raise RuntimeError("step failure")
            last = generated[-1] if generated else request.prompt_token_ids[-1]
            generated.append(last + 1)
            done = len(generated) >= request.max_tokens
            logprobs = np.full((1, 3), -0.5, dtype=np.float32) if request.logprobs else None
            outputs.append(
                EngineCoreOutput(request_id, [last + 1], "length" if done else None, None, logprobs)
            )
            if done:
                del self.requests[request_id]
        return EngineCoreOutputs(outputs, self.make_stats(), time.time())

    def num_requests(self) -> int:
        return len(self.requests)

    def programs_ready(self) -> tuple[int, int]:
        return (0, 0)

    def reset_prefix_cache(self) -> bool:
        return True

    def echo(self, *args: Any) -> list[Any]:
        return list(args)

    def slow_call(self, seconds: float) -> bool:
        time.sleep(seconds)
        return True

    def shutdown(self) -> None:
        pass


class FakeEngineCoreProc(EngineCoreProc, FakeEngineCore):
    """The real socket loop over the stand-in core (spawned by the MP clients)."""


class FakeConfig(dict):
    """The fake core's dict config with the fields the data-parallel clients read."""

    def __init__(self, data_parallel_size: int = 2, block_size: int = 4, **options: Any) -> None:
        from types import SimpleNamespace

        from xlm.config import ParallelConfig

        super().__init__(options)
        self.parallel_config = ParallelConfig(data_parallel_size=data_parallel_size)
        self.cache_config = SimpleNamespace(block_size=block_size)
        self.scheduler_config = SimpleNamespace(max_num_seqs=8)
        self.kv_events_config = None  # the DP client subscribes to events of its own
