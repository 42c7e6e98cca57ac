"""A lazy GGUF file reader: metadata and tensor table parsed once, tensor bytes memory-mapped.

`gguf.GGUFReader` builds a numpy object per vocabulary entry and takes seconds on a
tokenizer-sized file; this reader walks the header with `struct` and keeps the tensor data
untouched until a tensor is asked for.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: fixed-size scalars by struct format; 8 = string, 9 = array.
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor's entry in the table: name, shape in numpy order, ggml type, file offset."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the raw uint8 rows, as `gguf.quants.dequantize` expects them."""
        block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return (*self.shape[:-1], self.shape[-1] // block_size * type_size)


class GGUFFile:
    """A parsed GGUF header over a memory map of the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        with open(path, "rb") as f:
            # The header is walked on the mmap itself (a slice is plain bytes, cheaper per
            # vocabulary string than a numpy slice); the tensors are numpy views of the map.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._blob = np.frombuffer(self._map, dtype=np.uint8)
        if self._map[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._map, 4)
        if version not in _VERSIONS:
            raise ValueError(f"{path} is GGUF version {version}; supported versions: {_VERSIONS}")
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = self._read_string(pos)
            (value_type,) = struct.unpack_from("<I", self._map, pos)
            self.metadata[key], pos = self._read_value(pos + 4, value_type)
        infos = []
        for _ in range(tensor_count):
            name, pos = self._read_string(pos)
            (n_dims,) = struct.unpack_from("<I", self._map, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, pos + 4)
            tensor_type, offset = struct.unpack_from("<IQ", self._map, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            qtype = GGMLQuantizationType(tensor_type)
            # ggml lists dimensions fastest-moving first; numpy the other way round.
            shape = tuple(int(d) for d in reversed(dims))
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block_size * type_size
            infos.append(GGUFTensorInfo(name, shape, qtype, offset, nbytes))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        self._data_start = (pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {info.name: info for info in infos}

    @cached_property
    def architecture(self) -> str:
        """The `general.architecture` value (llama, qwen2, ...)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path} has no general.architecture in its metadata")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` when the key is absent."""
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a read-only uint8 view shaped for dequantization."""
        info = self.tensors[name]
        start = self._data_start + info.offset
        return self._blob[start : start + info.nbytes].reshape(info.byte_shape)

    def _read_string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        pos += 8
        return self._map[pos : pos + length].decode("utf-8", errors="replace"), pos + length

    def _read_value(self, pos: int, value_type: int) -> tuple[Any, int]:
        if value_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[value_type]
            (value,) = struct.unpack_from(fmt, self._map, pos)
            return value, pos + struct.calcsize(fmt)
        if value_type == _STRING:
            return self._read_string(pos)
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                width = struct.calcsize(fmt)
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._map, pos))
                return values, pos + count * width
            values = []
            for _ in range(count):
                value, pos = self._read_value(pos, item_type)
                values.append(value)
            return values, pos
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")
