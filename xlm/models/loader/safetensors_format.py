"""Hugging Face safetensors directories: one file or shards listed by an index."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # compressed-tensors fp8 weights
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's .safetensors files: the index's shards, else every file in the dir."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"Model directory {model_dir!r} does not exist")
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    files = sorted(
        os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")
    )
    if not files:
        raise FileNotFoundError(
            f"No weights found in {model_dir!r}: looked for {SINGLE_FILE}, {INDEX_FILE} "
            "or any *.safetensors file"
        )
    return files


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: the header length {header_len} exceeds the file")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header, 8 + header_len


def count_safetensors_tensors(model_dir: str) -> int:
    """How many tensors the checkpoint holds (for the progress bar)."""
    return sum(len(_read_header(p)[0]) for p in safetensors_files(model_dir))


def safetensors_dtypes(model_dir: str) -> dict[str, str]:
    """Each tensor's safetensors dtype name ("I8", "F8_E4M3", "BF16", ...), headers only."""
    return {
        name: info["dtype"]
        for path in safetensors_files(model_dir)
        for name, info in _read_header(path)[0].items()
    }


def iter_safetensors_tensors(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) one tensor at a time, memory-mapped (bf16 via ml_dtypes)."""
    for path in safetensors_files(model_dir):
        yield from iter_safetensors_file(path)


def iter_safetensors_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of one .safetensors file, memory-mapped, in header order."""
    header, data_start = _read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        for name, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            if data_start + end > len(mm) or begin > end:
                raise ValueError(f"{path}: tensor {name!r} lies past the end of the file")
            raw = mm[data_start + begin : data_start + end]
            yield name, raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    finally:
        del mm


def encode_header(tensors: Iterable[tuple[str, Any, Sequence[int]]]) -> bytes:
    """A .safetensors file's opening bytes (length, then the JSON header padded to 8) for
    tensors of these (name, dtype, shape), stored one after the other in that order."""
    names = {np.dtype(t): n for n, t in _DTYPES.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        dtype = np.dtype(dtype)
        if dtype not in names:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {
            "dtype": names[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` as one .safetensors file (any dtype `iter_safetensors_file` reads),
    streaming each array's bytes after the header."""
    with open(path, "wb") as f:
        f.write(encode_header((n, a.dtype, a.shape) for n, a in arrays.items()))
        for array in arrays.values():
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
