"""GGUF quantized tensors as codes + group scales: bit-exact against `gguf.quants.dequantize`."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from xlm.models.loader import gguf_quants
from xlm.models.loader.gguf import _unpermute_rotary, open_gguf
from xlm.models.loader.gguf_quants import (
    SUPPORTED,
    QuantizedWeight,
    decode,
    dequantize,
    dequantize_raw,
    unpermute_rotary,
)

Q = GGMLQuantizationType
# Byte offsets of each block's f16 factors (d, and dmin / m where the type has one).
F16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
OUT, IN = 24, 512


def random_blocks(qtype: GGMLQuantizationType, out: int, in_: int, seed: int) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, with small finite f16 factors."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = out * in_ // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        factor = rng.uniform(-0.05, 0.05, size=(num_blocks, 1)).astype(np.float16)
        blocks[:, start : start + 2] = factor.view(np.uint8)
    return blocks.reshape(out, -1)


def assert_matches_reference(raw: np.ndarray, qtype, out: int, in_: int) -> QuantizedWeight:
    qw = decode(raw, qtype, (out, in_))
    fmt = SUPPORTED[qtype]
    num_groups = in_ // fmt.group_size
    assert qw.codes.dtype == np.int8 and qw.codes.shape == (in_, out)
    assert qw.scale.dtype == np.float32 and qw.scale.shape == (num_groups, out)
    assert qw.group_size == fmt.group_size and qw.qtype == qtype.name
    if fmt.has_minimum:
        assert qw.minimum.dtype == np.float32 and qw.minimum.shape == (num_groups, out)
    else:
        assert qw.minimum is None
    assert fmt.code_min <= qw.codes.min() and qw.codes.max() <= fmt.code_max
    expected = reference_dequantize(raw, qtype).reshape(out, in_)
    np.testing.assert_array_equal(dequantize(qw), expected.T)
    direct = dequantize_raw(raw, qtype, (out, in_))  # the loader's float32 path
    assert direct.dtype == np.float32 and direct.flags.owndata
    np.testing.assert_array_equal(direct, expected)
    return qw


def test_supported_matches_ggml_block_sizes():
    for qtype, fmt in SUPPORTED.items():
        block_size, _ = GGML_QUANT_SIZES[qtype]
        assert block_size % fmt.group_size == 0, qtype.name
        assert -128 <= fmt.code_min < fmt.code_max <= 127
    assert set(SUPPORTED) == set(F16_FIELDS)


@pytest.mark.parametrize("qtype", list(SUPPORTED), ids=lambda q: q.name)
def test_random_blocks_match_reference_and_span_code_range(qtype):
    raw = random_blocks(qtype, OUT, IN, seed=int(qtype))
    qw = assert_matches_reference(raw, qtype, OUT, IN)
    # Random quants reach both ends of the claimed range: an off-by-offset would show here.
    fmt = SUPPORTED[qtype]
    assert (qw.codes.min(), qw.codes.max()) == (fmt.code_min, fmt.code_max)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_quantized_data_matches_reference(qtype):
    data = np.random.default_rng(0).standard_normal((OUT, IN)).astype(np.float32)
    raw = reference_quantize(data, qtype)
    qw = assert_matches_reference(raw, qtype, OUT, IN)
    # Within one quantization step of the data (the symmetric types clip their largest
    # positive value by up to a step), where a scrambled layout is off by many steps.
    step = np.abs(np.repeat(qw.scale, qw.group_size, axis=0))
    assert np.all(np.abs(dequantize(qw) - data.T) <= step)


def test_unpermute_rotary_matches_permuting_dequantized_tensor():
    num_heads = 3  # out=24: head_dim 8
    raw = random_blocks(Q.Q4_K, OUT, IN, seed=1)
    qw = unpermute_rotary(decode(raw, Q.Q4_K, (OUT, IN)), num_heads)
    expected = _unpermute_rotary(reference_dequantize(raw, Q.Q4_K).reshape(OUT, IN), num_heads)
    np.testing.assert_array_equal(dequantize(qw), expected.T)
    assert qw.codes.flags.c_contiguous and qw.minimum.flags.c_contiguous


def test_decode_rejects_bad_input():
    raw = random_blocks(Q.Q8_0, OUT, IN, seed=0)
    with pytest.raises(ValueError, match="qtype=Q2_K"):
        decode(raw, Q.Q2_K, (OUT, IN))
    with pytest.raises(ValueError, match="takes"):
        decode(raw, Q.Q8_0, (OUT + 1, IN))
    with pytest.raises(ValueError, match="block size 32"):
        decode(raw, Q.Q8_0, (OUT, IN - 16))


# ---- the real SmolLM2 GGUF (Q4_1 projections, a Q8_0 embedding; llama, so Q/K permuted) ----


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return open_gguf(smollm2_gguf)


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.3.ffn_down.weight"])
def test_smollm2_tensors_match_reference(smollm2, name):
    info = smollm2.tensors[name]
    assert info.tensor_type in (Q.Q8_0, Q.Q4_1)
    assert_matches_reference(smollm2.raw(name), info.tensor_type, *info.shape)


@pytest.mark.parametrize(
    ("name", "heads_key"),
    [
        ("blk.0.attn_q.weight", "llama.attention.head_count"),
        ("blk.0.attn_k.weight", "llama.attention.head_count_kv"),
    ],
)
def test_smollm2_qk_unpermuted_like_loader(smollm2, name, heads_key):
    info = smollm2.tensors[name]
    num_heads = smollm2.get(heads_key)
    raw = smollm2.raw(name)
    qw = gguf_quants.unpermute_rotary(decode(raw, info.tensor_type, info.shape), num_heads)
    weights = reference_dequantize(raw, info.tensor_type).reshape(info.shape)
    np.testing.assert_array_equal(dequantize(qw), _unpermute_rotary(weights, num_heads).T)
