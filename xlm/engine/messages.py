"""The engine's wire messages: everything that crosses the engine-core socket.

The engine-core client (in the front-end process) and `EngineCoreProc` (in the engine
process) exchange multipart ZeroMQ messages: the first frame is the message type, the
others the msgpack frames of its payload (`xlm/engine/serial.py`).

client -> engine
    ADD(EngineCoreRequest), ABORT([request ids]), UTILITY([call_id, method, args]),
    SHUTDOWN(None)
engine -> client
    READY({pid, max_model_len, num_blocks}), OUTPUTS(EngineCoreOutputs),
    QUEUE_TIMES({request id: seconds}), UTILITY_RESULT([call_id, ok, result or message]),
    ENGINE_ERROR(message); ENGINE_DEAD(message) is pushed by the client's own process
    monitor when the engine process exits.

`EngineCoreOutput` (one request's new tokens) is made by the scheduler, below the engine,
so it lives in `xlm/core/outputs.py`; it is re-exported here with the messages it rides in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xlm.core.outputs import EngineCoreOutput, SchedulerStats
from xlm.lora.request import LoRARequest
from xlm.multimodal.inputs import MultiModalFeature
from xlm.pooling_params import PoolingParams
from xlm.sampling_params import SamplingParams

__all__ = [
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "OutputType",
    "RequestType",
    "UtilityResult",
]


class RequestType:
    """First frame of a client -> engine message."""

    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"
    SHUTDOWN = b"S"


class OutputType:
    """First frame of an engine -> client message."""

    READY = b"R"
    OUTPUTS = b"O"
    # {request_id: seconds from admission to first schedule}, sent before that step's OUTPUTS.
    QUEUE_TIMES = b"Q"
    UTILITY_RESULT = b"U"
    ENGINE_ERROR = b"E"
    # Sent by the client's own process monitor when the engine process exits.
    ENGINE_DEAD = b"D"


@dataclass
class EngineCoreRequest:
    """A request as the engine core receives it (msgpack-able through ``to_dict``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # The prompt text when the user gave text (for RequestOutput.prompt); not used by the core.
    prompt: str | None = None
    # Set for a request to a pooling model: the request is prefilled once and pooled into
    # one vector (its sampling_params are a placeholder that samples nothing).
    pooling_params: PoolingParams | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # Its images: pixels, content hashes and placeholder positions (None: text only).
    mm_features: list[MultiModalFeature] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for msgpack."""
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling_params": self.sampling_params.to_dict(),
            "eos_token_id": self.eos_token_id,
            "arrival_time": self.arrival_time,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
            "prompt": self.prompt,
            "pooling_params": self.pooling_params,
            "lora_request": self.lora_request,
            "mm_features": self.mm_features,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineCoreRequest:
        """Inverse of ``to_dict``."""
        data = dict(data)
        data["sampling_params"] = SamplingParams.from_dict(data["sampling_params"])
        return cls(**data)


@dataclass(slots=True)
class EngineCoreOutputs:
    """What one step of the core returns to its client."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # The data-parallel rank these came from (its client sets it on receipt).
    engine_index: int = 0


# Payload of UTILITY_RESULT: (call_id, ok, the method's result or the error message).
UtilityResult = tuple[int, bool, Any]
