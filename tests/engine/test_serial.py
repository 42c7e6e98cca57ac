"""msgpack framing: round trips of requests, outputs and numpy arrays."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import pytest

from xlm.engine.serial import MsgpackDecoder, MsgpackEncoder, register_wire_class


@register_wire_class
class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


@register_wire_class
@dataclass(slots=True)
class Inner:
    token_ids: list[int]
    logprobs: np.ndarray | None = None


@register_wire_class
@dataclass
class Outer:
    request_id: str
    inner: list[Inner]
    kind: Color = Color.RED
    tags: set[str] = field(default_factory=set)
    pair: tuple[int, str] = (1, "a")
    mapping: dict[int, float] = field(default_factory=dict)
    calls: int = 0

    def __post_init__(self) -> None:
        self.calls += 1


@register_wire_class
class WithDict:
    def __init__(self, a: int, b: list[str]) -> None:
        self.a, self.b = a, b

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b}

    @classmethod
    def from_dict(cls, data: dict) -> WithDict:
        return cls(data["a"], data["b"])


def _roundtrip(obj):
    frames = MsgpackEncoder().encode(obj)
    return MsgpackDecoder().decode(frames), frames


def test_dataclass_roundtrip_keeps_types_and_skips_post_init():
    obj = Outer(
        "req-1",
        [Inner([1, 2, 3]), Inner([], np.arange(6, dtype=np.float32).reshape(2, 3))],
        Color.BLUE,
        {"x", "y"},
        (7, "z"),
        {5: 0.5, -1: 2.0},
    )
    out, _ = _roundtrip(obj)
    assert isinstance(out, Outer) and out.request_id == "req-1"
    assert out.kind is Color.BLUE
    assert out.tags == {"x", "y"} and out.pair == (7, "z")
    assert out.mapping == {5: 0.5, -1: 2.0}
    assert out.calls == 1  # __post_init__ not re-run
    assert isinstance(out.inner[0], Inner) and out.inner[0].token_ids == [1, 2, 3]
    np.testing.assert_array_equal(out.inner[1].logprobs, obj.inner[1].logprobs)


def test_large_arrays_travel_out_of_band_without_copies():
    big = np.random.default_rng(0).standard_normal((64, 20)).astype(np.float32)
    small = np.array([1, 2, 3], dtype=np.int32)
    frames = MsgpackEncoder().encode({"big": big, "small": small})
    assert len(frames) == 2  # body + one buffer for the big array
    assert isinstance(frames[1], memoryview)
    out = MsgpackDecoder().decode(frames)
    np.testing.assert_array_equal(out["big"], big)
    np.testing.assert_array_equal(out["small"], small)
    assert out["big"].dtype == np.float32 and out["small"].dtype == np.int32
    # The decoded array views the received frame's memory.
    assert np.shares_memory(out["big"], np.frombuffer(frames[1], dtype=np.uint8))


def test_to_dict_objects_and_numpy_scalars():
    out, _ = _roundtrip([WithDict(3, ["s"]), np.int64(5), np.float32(0.25)])
    assert isinstance(out[0], WithDict) and out[0].a == 3 and out[0].b == ["s"]
    assert out[1] == 5 and out[2] == 0.25


def test_real_sampling_params_roundtrip():
    from xlm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["x"], logit_bias={3: 1.0})
    out, _ = _roundtrip(params)
    assert out.temperature == 0.5 and out.max_tokens == 7 and out.stop == ["x"]
    assert out.logit_bias == {3: 1.0}


def test_refuses_classes_outside_allowed_modules():
    frames = MsgpackEncoder().encode(Inner([1]))
    body = bytes(frames[0]).replace(b"tests.engine.test_serial", b"os." + b"x" * 21)
    with pytest.raises(ValueError, match="refusing"):
        MsgpackDecoder().decode([body])


def test_unencodable_object_is_a_type_error():
    with pytest.raises(TypeError, match="cannot encode"):
        MsgpackEncoder().encode(object())


class Unregistered:
    def __init__(self, a: int) -> None:
        self.a = a

    def to_dict(self) -> dict:
        return {"a": self.a}

    @classmethod
    def from_dict(cls, data: dict) -> Unregistered:
        return cls(data["a"])


def test_only_registered_classes_decode_even_under_xlm():
    # An xlm class that is not a wire class (importable, but not in the registry).
    import msgpack

    body = msgpack.packb(msgpack.ExtType(3, msgpack.packb(["xlm.config:XlmConfig", {}, 0])))
    with pytest.raises(ValueError, match="not a registered wire class"):
        MsgpackDecoder().decode([body])
    # A test class that did not register itself: refused, though it is under tests.
    frames = MsgpackEncoder().encode(Unregistered(1))
    with pytest.raises(ValueError, match="not a registered wire class"):
        MsgpackDecoder().decode(frames)


def test_enum_values_and_dataclass_fields_are_checked():
    import msgpack

    body = msgpack.packb(
        msgpack.ExtType(4, msgpack.packb(["xlm.sampling_params:RequestOutputKind", 99]))
    )
    with pytest.raises(ValueError, match="not a valid"):
        MsgpackDecoder().decode([body])
    frames = MsgpackEncoder().encode(Inner([1]))
    bad = bytes(frames[0]).replace(b"token_ids", b"token_idz")
    with pytest.raises(ValueError, match="unknown fields"):
        MsgpackDecoder().decode([bad])
    from xlm.sampling_params import RequestOutputKind

    kind, _ = _roundtrip(RequestOutputKind.DELTA)
    assert kind is RequestOutputKind.DELTA


def test_everything_the_engine_sends_decodes():
    """Logprobs and structured-output specs cross the socket inside the real messages."""
    from xlm.core.outputs import EngineCoreOutput, LogprobsLists
    from xlm.engine.messages import EngineCoreOutputs
    from xlm.sampling_params import SamplingParams
    from xlm.structured_output.params import StructuredOutputsParams

    logprobs = LogprobsLists(
        logprob_token_ids=[[5, 6]], logprobs=[[-0.1, -2.0]], sampled_token_ranks=[1]
    )
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [5], new_logprobs=logprobs, new_prompt_logprobs=logprobs)]
    )
    back = MsgpackDecoder().decode(MsgpackEncoder().encode(outputs))
    assert isinstance(back.outputs[0].new_logprobs, LogprobsLists)
    assert back.outputs[0].new_logprobs.logprobs == [[-0.1, -2.0]]
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    back = MsgpackDecoder().decode(MsgpackEncoder().encode(params))
    assert isinstance(back.structured_outputs, StructuredOutputsParams)
    assert back.structured_outputs.regex == "[ab]+"


def test_a_request_with_images_crosses_the_socket():
    """An EngineCoreRequest's images (pixels out of band, hash, placeholders) decode whole."""
    from xlm.engine.messages import EngineCoreRequest
    from xlm.multimodal.inputs import MultiModalFeature
    from xlm.sampling_params import SamplingParams

    pixels = np.arange(3 * 8 * 8, dtype=np.float32).reshape(3, 8, 8)
    request = EngineCoreRequest(
        "r",
        [1, 9, 9, 9, 2],
        SamplingParams(max_tokens=3),
        None,
        0.0,
        mm_features=[MultiModalFeature("image", "abc", 1, 3, pixels)],
    )
    frames = MsgpackEncoder().encode(request)
    assert len(frames) > 1  # the pixels travel as their own frame
    back = MsgpackDecoder().decode(frames)
    assert isinstance(back, EngineCoreRequest)
    feature = back.mm_features[0]
    assert isinstance(feature, MultiModalFeature)
    assert (feature.identifier, feature.offset, feature.length) == ("abc", 1, 3)
    np.testing.assert_array_equal(feature.pixel_values, pixels)
