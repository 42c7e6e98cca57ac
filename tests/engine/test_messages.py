"""The engine's wire messages: an EngineCoreRequest survives to_dict/from_dict and the real
msgpack framing with every field (the framing itself: tests/engine/test_serial.py), and
the message-type frames are distinct single bytes."""

from __future__ import annotations

import pytest

from xlm.core.outputs import EngineCoreOutput
from xlm.engine.messages import EngineCoreOutputs, EngineCoreRequest, OutputType, RequestType
from xlm.engine.serial import MsgpackDecoder, MsgpackEncoder
from xlm.lora.request import LoRARequest
from xlm.pooling_params import PoolingParams
from xlm.sampling_params import SamplingParams


def _requests() -> list[EngineCoreRequest]:
    full = EngineCoreRequest(
        request_id="r-1",
        prompt_token_ids=[3, 1, 4, 1, 5],
        sampling_params=SamplingParams(
            temperature=0.5, top_p=0.9, seed=7, stop=["\n\n"], max_tokens=12, logprobs=2
        ),
        eos_token_id=2,
        arrival_time=123.25,
        priority=-3,
        cache_salt="salt",
        prompt="pi digits",
        lora_request=LoRARequest("adapter", 4, "/adapters/a"),
    )
    pooling = EngineCoreRequest(
        "r-2", [9], SamplingParams(max_tokens=1), None, 0.0, pooling_params=PoolingParams()
    )
    return [full, pooling]


@pytest.mark.parametrize("index", [0, 1])
def test_a_request_round_trips_through_to_dict(index):
    request = _requests()[index]
    data = request.to_dict()
    assert isinstance(data["sampling_params"], dict)  # plain data for msgpack
    assert EngineCoreRequest.from_dict(data) == request
    assert isinstance(data["sampling_params"], dict)  # from_dict left its input alone


@pytest.mark.parametrize("index", [0, 1])
def test_a_request_round_trips_through_the_wire_framing(index):
    request = _requests()[index]
    back = MsgpackDecoder().decode(MsgpackEncoder().encode(request))
    assert isinstance(back, EngineCoreRequest) and back == request
    assert back.sampling_params.stop == request.sampling_params.stop
    assert back.lora_request == request.lora_request


def test_outputs_round_trip_and_frames_are_distinct():
    outputs = EngineCoreOutputs([EngineCoreOutput("r", [5, 6], "stop")], timestamp=2.5)
    back = MsgpackDecoder().decode(MsgpackEncoder().encode(outputs))
    assert back.timestamp == 2.5 and back.outputs[0].new_token_ids == [5, 6]
    assert back.outputs[0].finish_reason == "stop"
    for kind in (RequestType, OutputType):
        frames = [v for k, v in vars(kind).items() if k.isupper()]
        assert all(isinstance(f, bytes) and len(f) == 1 for f in frames)
        assert len(set(frames)) == len(frames)
