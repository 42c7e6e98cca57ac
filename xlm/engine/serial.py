"""msgpack framing between the engine-core client and the engine-core process.

A message is a list of frames: the first is the msgpack body, the others are raw
buffers of numpy arrays too large to inline (sent as their own ZeroMQ frames and
read back with ``np.frombuffer``, so neither side copies them).

Beyond msgpack's own types the encoder handles numpy arrays and scalars, sets,
enums, dataclasses (field by field, without re-running ``__post_init__``) and
objects with ``to_dict``/``from_dict`` (``SamplingParams``). Classes are named by
their import path; only those in the explicit registry (``WIRE_CLASSES``, plus what
``register_wire_class`` adds) decode, and an unknown name or enum value is an error.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

# Extension type codes.
_EXT_NDARRAY = 1  # [dtype, shape, bytes] inline
_EXT_NDARRAY_FRAME = 2  # [dtype, shape, frame index] out of band
_EXT_OBJECT = 3  # [class path, {field: value}] dataclass / to_dict object
_EXT_ENUM = 4  # [class path, value]
_EXT_SET = 5  # [items]
_EXT_TUPLE = 6  # [items]

# Arrays at least this many bytes travel as their own frame instead of inline.
INLINE_ARRAY_BYTES = 256

Frame = bytes | bytearray | memoryview


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# The classes that may cross the engine socket, by where they are imported from (the
# registry keys them by their own module:qualname, so a class moved behind a re-export
# still resolves). Nothing else decodes: no import happens on a name a message carries.
WIRE_CLASSES: tuple[tuple[str, str], ...] = (
    ("xlm.engine.messages", "EngineCoreRequest"),
    ("xlm.sampling_params", "SamplingParams"),
    ("xlm.sampling_params", "RequestOutputKind"),
    ("xlm.sampling_params", "SamplingType"),
    ("xlm.pooling_params", "PoolingParams"),
    ("xlm.pooling_params", "PoolingType"),
    ("xlm.lora.request", "LoRARequest"),
    ("xlm.multimodal.inputs", "MultiModalFeature"),
    ("xlm.structured_output.params", "StructuredOutputsParams"),
    ("xlm.core.outputs", "EngineCoreOutput"),
    ("xlm.core.outputs", "LogprobsLists"),
    ("xlm.core.outputs", "SchedulerStats"),
    ("xlm.engine.messages", "EngineCoreOutputs"),
)

_registry: dict[str, type] = {}
_builtins_loaded = False


def register_wire_class(cls: type) -> type:
    """Allow `cls` to be decoded (usable as a class decorator; tests register their fakes)."""
    _registry[_class_path(cls)] = cls
    return cls


def _load_wire_classes() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    for module_name, name in WIRE_CLASSES:
        register_wire_class(getattr(importlib.import_module(module_name), name))
    _builtins_loaded = True


def _resolve_class(path: str) -> type:
    cls = _registry.get(path)
    if cls is None:
        _load_wire_classes()
        cls = _registry.get(path)
    if cls is None:
        raise ValueError(f"refusing to decode class {path!r}: not a registered wire class")
    return cls


class MsgpackEncoder:
    """Encodes one message into frames; large numpy arrays become extra frames."""

    def __init__(self, inline_array_bytes: int = INLINE_ARRAY_BYTES) -> None:
        self.inline_array_bytes = inline_array_bytes
        self._aux: list[Frame] | None = None

    def encode(self, obj: Any) -> list[Frame]:
        """The frames of one message: the msgpack body, then out-of-band array buffers."""
        self._aux = []
        try:
            body = msgpack.packb(obj, default=self._default, use_bin_type=True, strict_types=True)
            return [body, *self._aux]
        finally:
            self._aux = None

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_array(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, enum.Enum):
            return msgpack.ExtType(_EXT_ENUM, self._pack([_class_path(type(obj)), obj.value]))
        if isinstance(obj, set | frozenset):
            return msgpack.ExtType(_EXT_SET, self._pack(list(obj)))
        if isinstance(obj, tuple):
            if hasattr(obj, "_fields"):  # namedtuple: keep as a plain list
                return list(obj)
            return msgpack.ExtType(_EXT_TUPLE, self._pack(list(obj)))
        if isinstance(obj, list):  # list subclasses under strict_types
            return list(obj)
        if isinstance(obj, dict):
            return dict(obj)
        for base in (bool, int, float, str, bytes):  # subclasses of builtins
            if isinstance(obj, base):
                return base(obj)
        if hasattr(obj, "to_dict") and hasattr(type(obj), "from_dict"):
            state = obj.to_dict()
            return msgpack.ExtType(_EXT_OBJECT, self._pack([_class_path(type(obj)), state, 1]))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            state = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return msgpack.ExtType(_EXT_OBJECT, self._pack([_class_path(type(obj)), state, 0]))
        raise TypeError(f"cannot encode an object of type {type(obj).__qualname__}")

    def _pack(self, obj: Any) -> bytes:
        return msgpack.packb(obj, default=self._default, use_bin_type=True, strict_types=True)

    def _encode_array(self, arr: np.ndarray) -> msgpack.ExtType:
        if arr.dtype.hasobject:
            raise TypeError("cannot encode a numpy array of Python objects")
        arr = np.ascontiguousarray(arr)
        dtype = arr.dtype.str
        shape = list(arr.shape)
        if arr.nbytes < self.inline_array_bytes or self._aux is None:
            return msgpack.ExtType(_EXT_NDARRAY, self._pack([dtype, shape, arr.tobytes()]))
        self._aux.append(arr.data if arr.ndim else arr.tobytes())
        return msgpack.ExtType(_EXT_NDARRAY_FRAME, self._pack([dtype, shape, len(self._aux)]))


class MsgpackDecoder:
    """Decodes the frames made by MsgpackEncoder."""

    def __init__(self) -> None:
        self._frames: Sequence[Any] = ()

    def decode(self, frames: Sequence[Any] | Frame) -> Any:
        """One message from its frames (bytes, memoryviews or zmq.Frame objects)."""
        if isinstance(frames, bytes | bytearray | memoryview):
            frames = [frames]
        self._frames = frames
        try:
            return self._unpack(_buffer(frames[0]))
        finally:
            self._frames = ()

    def _unpack(self, data: Any) -> Any:
        return msgpack.unpackb(
            data, ext_hook=self._ext_hook, raw=False, strict_map_key=False, use_list=True
        )

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_NDARRAY:
            dtype, shape, raw = self._unpack(data)
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        if code == _EXT_NDARRAY_FRAME:
            dtype, shape, index = self._unpack(data)
            buf = _buffer(self._frames[index])
            return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        if code == _EXT_ENUM:
            path, value = self._unpack(data)
            cls = _resolve_class(path)
            if not issubclass(cls, enum.Enum):
                raise ValueError(f"refusing to decode {path!r} as an enum: it is not one")
            try:
                return cls(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a valid {path}") from None
        if code == _EXT_SET:
            return set(self._unpack(data))
        if code == _EXT_TUPLE:
            return tuple(self._unpack(data))
        if code == _EXT_OBJECT:
            path, state, via_from_dict = self._unpack(data)
            cls = _resolve_class(path)
            if not isinstance(state, dict):
                raise ValueError(f"bad state for {path}: expected a mapping")
            if via_from_dict:
                return cls.from_dict(state)
            if not dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum):
                raise ValueError(f"refusing to decode {path!r} field by field: not a dataclass")
            unknown = set(state) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"bad state for {path}: unknown fields {sorted(unknown)}")
            obj = cls.__new__(cls)
            for name, value in state.items():
                object.__setattr__(obj, name, value)
            return obj
        raise ValueError(f"unknown msgpack extension type {code}")


def _buffer(frame: Any) -> Any:
    """The bytes-like payload of a frame (zmq.Frame exposes .buffer without copying)."""
    buf = getattr(frame, "buffer", None)
    return frame if buf is None else buf
