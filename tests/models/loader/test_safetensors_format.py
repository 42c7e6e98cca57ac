"""The safetensors reader: files found through the index or the directory, headers read
alone, and every tensor equal to what the `safetensors` package wrote, for every dtype;
malformed files are refused with the file and tensor named (loading whole checkpoints:
tests/models/test_loader.py)."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from xlm.models.loader.safetensors_format import (
    INDEX_FILE,
    count_safetensors_tensors,
    iter_safetensors_file,
    iter_safetensors_tensors,
    safetensors_dtypes,
    safetensors_files,
    write_safetensors,
)

RNG = np.random.default_rng(0)
TENSORS = {
    "f64": RNG.standard_normal((2, 3)),
    "f32": RNG.standard_normal((4,)).astype(np.float32),
    "f16": RNG.standard_normal((3, 2)).astype(np.float16),
    "bf16": RNG.standard_normal((2, 2, 2)).astype(ml_dtypes.bfloat16),
    "fp8": RNG.standard_normal((5,)).astype(ml_dtypes.float8_e4m3fn),
    "i64": np.array([-(2**40), 3]),
    "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
    "i16": np.array([-5, 7], np.int16),
    "i8": np.array([-128, 127], np.int8),
    "u8": np.array([0, 255, 9], np.uint8),
    "bool": np.array([True, False]),
    "scalar": np.array(2.5, np.float32),
}
DTYPES = {
    "f64": "F64", "f32": "F32", "f16": "F16", "bf16": "BF16", "fp8": "F8_E4M3", "i64": "I64",
    "i32": "I32", "i16": "I16", "i8": "I8", "u8": "U8", "bool": "BOOL", "scalar": "F32",
}  # fmt: skip


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


def test_one_file_of_every_dtype(tmp_path):
    save_file(TENSORS, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    _assert_same({n: np.array(v) for n, v in iter_safetensors_tensors(str(tmp_path))}, TENSORS)
    assert safetensors_dtypes(str(tmp_path)) == DTYPES
    assert count_safetensors_tensors(str(tmp_path)) == len(TENSORS)


def test_the_writer_round_trips_every_dtype_and_the_package_reads_it(tmp_path):
    """xlm's writer (the placed-weights cache's): read back by xlm's reader, and by the
    `safetensors` package where numpy has the dtype."""
    from safetensors.numpy import load_file

    path = str(tmp_path / "model.safetensors")
    write_safetensors(path, TENSORS)
    _assert_same({n: np.array(v) for n, v in iter_safetensors_file(path)}, TENSORS)
    native = {n: v for n, v in TENSORS.items() if n not in ("bf16", "fp8")}
    write_safetensors(path, native)
    _assert_same(load_file(path), native)


def test_shards_come_from_the_index_and_stray_files_are_ignored(tmp_path):
    names = sorted(TENSORS)
    shards = {"b-00002.safetensors": names[1::2], "a-00001.safetensors": names[::2]}
    for shard, shard_names in shards.items():
        save_file({n: TENSORS[n] for n in shard_names}, str(tmp_path / shard))
    save_file({"stray": np.zeros(1, np.float32)}, str(tmp_path / "stray.safetensors"))
    weight_map = {n: shard for shard, ns in shards.items() for n in ns}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    files = safetensors_files(str(tmp_path))
    assert files == [str(tmp_path / "a-00001.safetensors"), str(tmp_path / "b-00002.safetensors")]
    _assert_same({n: np.array(v) for n, v in iter_safetensors_tensors(str(tmp_path))}, TENSORS)
    weight_map["f32"] = "c-00003.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="lists shards that do not exist.*c-00003"):
        safetensors_files(str(tmp_path))


def test_missing_directories_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        safetensors_files(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"No weights found .*model\.safetensors"):
        safetensors_files(str(tmp_path))


def _write_raw(path, header: dict, data: bytes) -> str:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
    return str(path)


def test_malformed_files_are_refused(tmp_path):
    too_long = tmp_path / "long.safetensors"
    too_long.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="header length 1000000 exceeds the file"):
        list(iter_safetensors_file(str(too_long)))
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    short = _write_raw(tmp_path / "short.safetensors", {"w": entry}, bytes(8))
    with pytest.raises(ValueError, match="tensor 'w' lies past the end of the file"):
        list(iter_safetensors_file(short))
    odd = _write_raw(tmp_path / "odd.safetensors", {"w": {**entry, "dtype": "F8_E5M2"}}, bytes(16))
    with pytest.raises(ValueError, match="tensor 'w' has unsupported dtype F8_E5M2"):
        list(iter_safetensors_file(odd))
