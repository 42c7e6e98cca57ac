"""The placed cache (xlm/models/loader/placed_cache.py): a GGUF's parameters saved as
placed after the first load, loaded back bit-equal without reading the GGUF, one entry
per parameter signature, stale source versions replaced, broken entries rebuilt."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.models.gguf_fixtures import random_hf_state_dict, write_gguf
from xlm.engine.arg_utils import EngineArgs
from xlm.metrics import startup
from xlm.models import loader
from xlm.models.loader import _split, get_model, placed_cache
from xlm.ops import FloatMatmul


@pytest.fixture
def gguf(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("XLM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(startup, "_deferred", [])
    return write_gguf(str(tmp_path / "tiny.gguf"), "llama", random_hf_state_dict("llama"))


def _load(path: str, **engine: object) -> dict[str, np.ndarray]:
    """Every parameter of the model loaded from `path`, on the host."""
    config = EngineArgs(model=path, max_model_len=64, **engine).create_config()
    return {p: np.asarray(v.get_value()) for p, v in _split(get_model(config))[2].items()}


def _entries(tmp_path) -> list[str]:
    root = tmp_path / "cache" / "gguf_placed"
    return sorted(os.listdir(root)) if root.exists() else []


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for path, value in want.items():
        assert got[path].dtype == value.dtype, path
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def _no_gguf_reads(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was read although its placed parameters are cached")

    monkeypatch.setattr(loader, "iter_gguf_tensors", refuse)


@pytest.mark.parametrize("engine", [{}, {"quantization": "int8"}], ids=["float32", "int8"])
def test_a_warm_load_reads_the_placed_parameters_bit_equal(gguf, tmp_path, monkeypatch, engine):
    cold = _load(gguf, **engine)
    assert _entries(tmp_path) == []  # written after the first step, not before
    startup.run_deferred().join(60)
    assert len(_entries(tmp_path)) == 1
    with monkeypatch.context() as m:
        _no_gguf_reads(m)
        warm = _load(gguf, **engine)
    assert startup._notes["weights"] == "placed GGUF weights from the cache"
    _assert_equal(warm, cold)


def test_each_parameter_signature_has_its_own_entry(gguf, tmp_path, monkeypatch):
    floats = _load(gguf)
    startup.run_deferred().join(60)
    quantized = _load(gguf, quantization="int8")  # another signature: from the GGUF
    startup.run_deferred().join(60)
    # float32 kernels [in, out] (the float kernel off): the square ones (o_proj) have
    # their [out, in] shape, and the layout alone tells the entries apart.
    monkeypatch.setattr(FloatMatmul, "float32_kernel", False)
    columns = _load(gguf)
    startup.run_deferred().join(60)
    square = [p for p, v in columns.items() if v.ndim == 2 and v.shape[0] == v.shape[1]]
    assert any(p.endswith("o_proj.kernel") for p in square)
    for path in square:
        np.testing.assert_array_equal(columns[path], floats[path].T, err_msg=path)
    assert len(_entries(tmp_path)) == 3
    with monkeypatch.context() as m:
        _no_gguf_reads(m)
        _assert_equal(_load(gguf), columns)
        m.setattr(FloatMatmul, "float32_kernel", True)
        _assert_equal(_load(gguf), floats)
        _assert_equal(_load(gguf, quantization="int8"), quantized)


def test_a_new_source_version_replaces_the_stale_entry(gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(placed_cache, "_layout_source", lambda: "oldsource")
    expected = _load(gguf)
    startup.run_deferred().join(60)
    (stale,) = _entries(tmp_path)
    monkeypatch.setattr(placed_cache, "_layout_source", lambda: "newsource")
    _assert_equal(_load(gguf), expected)  # the stale entry is not read: the GGUF is
    startup.run_deferred().join(60)
    (fresh,) = _entries(tmp_path)
    assert stale.endswith("-oldsource") and fresh == stale.replace("oldsource", "newsource")


def test_a_broken_entry_is_discarded_and_the_gguf_read_again(gguf, tmp_path):
    expected = _load(gguf)
    startup.run_deferred().join(60)
    (entry,) = _entries(tmp_path)
    weights = tmp_path / "cache" / "gguf_placed" / entry / placed_cache.FILE
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    _assert_equal(_load(gguf), expected)
    assert _entries(tmp_path) == []  # discarded; rewritten after this load's first step
    startup.run_deferred().join(60)
    assert len(_entries(tmp_path)) == 1
