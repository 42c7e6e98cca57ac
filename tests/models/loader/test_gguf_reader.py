"""GGUFFile, xlm's lazy GGUF reader: its metadata and tensor bytes equal what the `gguf`
package wrote and what its own GGUFReader reads back, for every value type and for float
and block-quantized tensors."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from xlm.models.loader.gguf_reader import GGUFFile

RNG = np.random.default_rng(0)
F32 = RNG.standard_normal((3, 5)).astype(np.float32)
F16 = RNG.standard_normal((4, 6)).astype(np.float16)
Q8 = RNG.standard_normal((2, 64)).astype(np.float32)  # two blocks of 32 per row
I32 = np.arange(-3, 9, dtype=np.int32).reshape(2, 2, 3)
METADATA = {
    "t.u8": (GGUFValueType.UINT8, 250),
    "t.i8": (GGUFValueType.INT8, -7),
    "t.u16": (GGUFValueType.UINT16, 65535),
    "t.i16": (GGUFValueType.INT16, -300),
    "t.u32": (GGUFValueType.UINT32, 2**32 - 1),
    "t.i32": (GGUFValueType.INT32, -(2**31)),
    "t.f32": (GGUFValueType.FLOAT32, 0.5),
    "t.bool": (GGUFValueType.BOOL, True),
    "t.u64": (GGUFValueType.UINT64, 2**63 + 5),
    "t.i64": (GGUFValueType.INT64, -(2**40)),
    "t.f64": (GGUFValueType.FLOAT64, 1e-300),
    "t.str": (GGUFValueType.STRING, "héllo 日本"),
}


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf_reader") / "t.gguf")
    writer = GGUFWriter(path, "llama")
    for key, (value_type, value) in METADATA.items():
        writer.add_key_value(key, value, value_type)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, -1.5])
    writer.add_array("t.strings", ["a", "", "ünï"])
    writer.add_tensor("f32", F32)
    writer.add_tensor("f16", F16)
    writer.add_tensor("i32", I32)
    writer.add_tensor(
        "q8", quantize(Q8, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_of_every_value_type(path):
    gguf = GGUFFile(path)
    assert gguf.architecture == "llama" == gguf.get("general.architecture")
    for key, (value_type, value) in METADATA.items():
        got = gguf.get(key)
        if value_type == GGUFValueType.FLOAT32:
            assert got == pytest.approx(value)
        else:
            assert got == value, key
    assert gguf.get("t.ints") == [1, -2, 3]
    assert gguf.get("t.floats") == [0.25, -1.5]
    assert gguf.get("t.strings") == ["a", "", "ünï"]
    assert gguf.get("absent", "default") == "default"
    # The gguf package's reader agrees on every key.
    reference = GGUFReader(path)
    assert set(gguf.metadata) == {k for k in reference.fields if not k.startswith("GGUF.")}


def test_tensor_table_and_bytes_equal_what_was_written(path):
    gguf = GGUFFile(path)
    assert set(gguf.tensors) == {"f32", "f16", "i32", "q8"}
    np.testing.assert_array_equal(gguf.raw("f32").view(np.float32), F32)
    np.testing.assert_array_equal(gguf.raw("f16").view(np.float16), F16)
    np.testing.assert_array_equal(gguf.raw("i32").view(np.int32).reshape(I32.shape), I32)
    q8 = gguf.tensors["q8"]
    assert q8.shape == (2, 64) and q8.tensor_type == GGMLQuantizationType.Q8_0
    assert q8.byte_shape == (2, 2 * 34) and q8.nbytes == 136  # 32 codes + an f16 scale a block
    got = dequantize(gguf.raw("q8"), GGMLQuantizationType.Q8_0)
    want = dequantize(quantize(Q8, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, Q8, atol=0.05)
    reference = {t.name: t for t in GGUFReader(path).tensors}
    for name, info in gguf.tensors.items():
        np.testing.assert_array_equal(
            gguf.raw(name).reshape(-1), reference[name].data.view(np.uint8).reshape(-1)
        )
        assert info.tensor_type == reference[name].tensor_type


def test_bad_files_are_refused(tmp_path, path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        GGUFFile(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))
    old = tmp_path / "old.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match=r"GGUF version 1; supported versions: \(2, 3\)"):
        GGUFFile(str(old))
    bare = tmp_path / "bare.gguf"
    bare.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(ValueError, match="no general.architecture"):
        _ = GGUFFile(str(bare)).architecture
