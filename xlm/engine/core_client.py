"""Clients of the engine core: in this process, or (serving) in another over ZeroMQ."""

from __future__ import annotations

from typing import Any, Protocol

from xlm.config import XlmConfig
from xlm.core.outputs import SchedulerStats
from xlm.engine.core import EngineCore
from xlm.engine.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(Protocol):
    """What LLMEngine needs of the engine core, wherever the core runs."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_compilations(self) -> int: ...

    def get_encoder_cache_stats(self) -> dict[str, int]: ...

    def wait_for_programs(self, timeout: float | None = None) -> bool: ...

    def get_stats(self) -> SchedulerStats: ...

    def shutdown(self) -> None: ...


class InprocClient:
    """Calls the EngineCore directly: each get_output() runs one step.

    Why a layer: LLMEngine talks to every core through the same client interface
    (`EngineCoreClient`), so the same engine runs the core in this process or in another
    (`SyncMPClient`) without branching.
    """

    def __init__(self, config: XlmConfig, log_stats: bool = True) -> None:
        self.engine_core = EngineCore(config, log_stats=log_stats)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_num_compilations(self) -> int:
        return self.engine_core.get_num_compilations()

    def get_encoder_cache_stats(self) -> dict[str, int]:
        return self.engine_core.get_encoder_cache_stats()

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        return self.engine_core.wait_for_programs(timeout)

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.make_stats()

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call a public EngineCore method (the multiprocess clients' UTILITY message;
        `timeout` is theirs: a call here returns when done)."""
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
