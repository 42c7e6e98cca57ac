"""GGUF block quantizations decoded into integer codes and per-group scales (and minimums).

Every supported format is, exactly, `W[i, j] = scale[i // gs, j] * codes[i, j] + minimum[i //
gs, j]` for a weight in xlm's kernel layout `[in, out]`: the block's f16 factors and its
sub-block scales fold into float32 `scale` and `minimum`, and the quants become small integer
codes. `dequantize(decode(raw, ...))` reproduces `gguf.quants.dequantize` bit for bit, since it
performs the same float32 operations in the same order.

GGUF stores a weight as numpy `[out, in]` with blocks running along `in`, so a group is a run
of `gs` input rows of one output column, and permuting output channels (llama.cpp's rotary
permutation of Q/K) permutes the `out` axis of codes, scale and minimum alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """A supported GGUF type: its group size and the range of its integer codes."""

    group_size: int
    code_min: int
    code_max: int
    has_minimum: bool


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A GGUF weight as int8 codes `[in, out]`, float32 `scale` and `minimum` `[G, out]`."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    group_size: int
    qtype: str

    @property
    def shape(self) -> tuple[int, int]:
        """The `[in, out]` shape of the weight."""
        return self.codes.shape

    def regroup(self, group_size: int) -> QuantizedWeight:
        """The same weight with a scale (and minimum) per `group_size` inputs, a divisor of
        this one's group size (each group's factors repeated: exact)."""
        if group_size <= 0 or self.group_size % group_size:
            raise ValueError(f"group_size={group_size} must divide {self.group_size}")
        r = self.group_size // group_size
        minimum = None if self.minimum is None else np.repeat(self.minimum, r, axis=0)
        return replace(
            self, scale=np.repeat(self.scale, r, axis=0), minimum=minimum, group_size=group_size
        )


_Q = GGMLQuantizationType
SUPPORTED: dict[GGMLQuantizationType, QuantFormat] = {
    _Q.Q8_0: QuantFormat(32, -128, 127, False),
    _Q.Q4_0: QuantFormat(32, -8, 7, False),
    _Q.Q4_1: QuantFormat(32, 0, 15, True),
    _Q.Q5_0: QuantFormat(32, -16, 15, False),
    _Q.Q5_1: QuantFormat(32, 0, 31, True),
    _Q.Q4_K: QuantFormat(32, 0, 15, True),
    _Q.Q5_K: QuantFormat(32, 0, 31, True),
    _Q.Q6_K: QuantFormat(16, -32, 31, False),
}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte `start` of each block, as float32 `[N, 1]`."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[N, k]` bytes -> `[N, 2k]` uint8: the low nibbles of all k bytes, then the high ones."""
    out = np.empty((qs.shape[0], 2 * qs.shape[1]), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, : qs.shape[1]])
    np.right_shift(qs, 4, out=out[:, qs.shape[1] :])
    return out


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4-byte qh (a little-endian uint32) -> `[N, 32]` bits shifted to 0x10."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _q8_0(blocks: np.ndarray) -> _Unpacked:
    return blocks[:, 2:].view(np.int8), _f16(blocks, 0), None


def _q4_0(blocks: np.ndarray) -> _Unpacked:
    codes = _nibbles(blocks[:, 2:]).view(np.int8)
    codes -= 8
    return codes, _f16(blocks, 0), None


def _q4_1(blocks: np.ndarray) -> _Unpacked:
    return _nibbles(blocks[:, 4:]).view(np.int8), _f16(blocks, 0), _f16(blocks, 2)


def _q5_0(blocks: np.ndarray) -> _Unpacked:
    codes = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).view(np.int8)
    codes -= 16
    return codes, _f16(blocks, 0), None


def _q5_1(blocks: np.ndarray) -> _Unpacked:
    codes = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).view(np.int8)
    return codes, _f16(blocks, 0), _f16(blocks, 2)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> two `[N, 8]` uint8 arrays."""
    # Bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7; bytes 4-7 the
    # same for mins; bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high).
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_factors(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = _f16(blocks, 0) * sc.astype(np.float32)
    # The reference subtracts dmin * m; adding its negation is the same float operation.
    minimum = -(_f16(blocks, 2) * mn.astype(np.float32))
    return scale, minimum


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> 256 nibbles: each 32-byte chunk gives 32 low, then 32 high."""
    n = qs.shape[0]
    return _nibbles(qs.reshape(n * 4, 32)).reshape(n, 256)


def _q4_k(blocks: np.ndarray) -> _Unpacked:
    scale, minimum = _k_factors(blocks)
    return _k_nibbles(blocks[:, 16:]).view(np.int8), scale, minimum


def _q5_k(blocks: np.ndarray) -> _Unpacked:
    scale, minimum = _k_factors(blocks)
    n = blocks.shape[0]
    # Element k * 32 + i takes bit k of qh byte i.
    bits = np.unpackbits(blocks[:, 16:48], axis=-1, bitorder="little").reshape(n, 32, 8)
    high = bits.transpose(0, 2, 1).reshape(n, 256) << 4
    return (_k_nibbles(blocks[:, 48:]) | high).view(np.int8), scale, minimum


def _q6_k(blocks: np.ndarray) -> _Unpacked:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    # Each half of 128 elements: element s * 64 + i takes nibble s of ql byte i (of 64), and
    # element k * 32 + i bits 2k..2k+1 of qh byte i (of 32).
    low = _nibbles(ql.reshape(n * 2, 64))
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    high = ((qh.reshape(n * 2, 1, 32) >> shifts) & 0x03).reshape(n * 2, 128) << 4
    codes = (low | high).reshape(n, 256).view(np.int8)
    codes -= 32
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return codes, scale, None


_UNPACK: dict[GGMLQuantizationType, Callable[[np.ndarray], _Unpacked]] = {
    _Q.Q8_0: _q8_0,
    _Q.Q4_0: _q4_0,
    _Q.Q4_1: _q4_1,
    _Q.Q5_0: _q5_0,
    _Q.Q5_1: _q5_1,
    _Q.Q4_K: _q4_k,
    _Q.Q5_K: _q5_k,
    _Q.Q6_K: _q6_k,
}


def _unpack(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape_out_in: tuple[int, int]
) -> tuple[_Unpacked, int, int]:
    """Each block's codes `[N, block]`, scales and minimums `[N, groups per block]`; out, in."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED:
        names = sorted(t.name for t in SUPPORTED)
        raise ValueError(f"qtype={qtype.name} is not a supported GGUF quantization; use {names}")
    if len(shape_out_in) != 2:
        raise ValueError(f"shape_out_in={shape_out_in} must be a 2-D (out, in) shape")
    out_features, in_features = (int(d) for d in shape_out_in)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if in_features % block_size:
        raise ValueError(
            f"shape_out_in={shape_out_in}: in={in_features} is not a multiple of "
            f"{qtype.name}'s block size {block_size}"
        )
    num_blocks = out_features * (in_features // block_size)
    raw = np.asarray(raw).view(np.uint8)
    if raw.size != num_blocks * type_size:
        raise ValueError(
            f"raw holds {raw.size} bytes; a {qtype.name} tensor of shape {shape_out_in} "
            f"takes {num_blocks * type_size}"
        )
    return _UNPACK[qtype](raw.reshape(num_blocks, type_size)), out_features, in_features


def decode(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape_out_in: tuple[int, int]
) -> QuantizedWeight:
    """Decode a GGUF tensor's bytes (numpy shape `[out, in]`) into a `QuantizedWeight`."""
    (codes, scale, minimum), out_features, in_features = _unpack(raw, qtype, shape_out_in)
    qtype = GGMLQuantizationType(qtype)
    group_size = SUPPORTED[qtype].group_size
    num_groups = in_features // group_size

    def kernel_layout(x: np.ndarray, columns: int) -> np.ndarray:
        # Always a copy: a view could keep the read-only GGUF map alive (one output row).
        return x.reshape(out_features, columns).T.copy()

    return QuantizedWeight(
        codes=kernel_layout(codes, in_features),
        scale=kernel_layout(scale, num_groups),
        minimum=None if minimum is None else kernel_layout(minimum, num_groups),
        group_size=group_size,
        qtype=qtype.name,
    )


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The float32 `[in, out]` weight a `QuantizedWeight` stands for."""
    in_features, out_features = qw.codes.shape
    num_groups = qw.scale.shape[0]
    codes = qw.codes.reshape(num_groups, qw.group_size, out_features).astype(np.float32)
    weight = codes * qw.scale[:, None, :]
    if qw.minimum is not None:
        weight += qw.minimum[:, None, :]
    return weight.reshape(in_features, out_features)


def dequantize_raw(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape_out_in: tuple[int, int]
) -> np.ndarray:
    """A GGUF tensor's bytes as its float32 `[out, in]` weight, in one pass over the codes:
    `gguf.quants.dequantize`'s values, without its per-row-group Python loop."""
    (codes, scale, minimum), out_features, in_features = _unpack(raw, qtype, shape_out_in)
    num_blocks, groups = scale.shape
    shape = (num_blocks, groups, codes.shape[1] // groups)
    weight = np.empty((out_features, in_features), np.float32)
    blocks = weight.reshape(shape)  # a view: the result owns its memory
    np.multiply(codes.reshape(shape), scale[:, :, None], out=blocks)
    if minimum is not None:
        blocks += minimum[:, :, None]
    return weight


def permute_out(qw: QuantizedWeight, index: np.ndarray) -> QuantizedWeight:
    """Reorder output channels: column `j` of the result is column `index[j]` of `qw`."""
    return QuantizedWeight(
        codes=np.ascontiguousarray(qw.codes[:, index]),
        scale=np.ascontiguousarray(qw.scale[:, index]),
        minimum=None if qw.minimum is None else np.ascontiguousarray(qw.minimum[:, index]),
        group_size=qw.group_size,
        qtype=qw.qtype,
    )


def rotary_unpermutation(out_features: int, num_heads: int) -> np.ndarray:
    """The output-channel order that undoes llama.cpp's Q/K rotary permutation.

    Matches `gguf._unpermute_rotary` on `[out, in]` rows: within each head, HF's row
    `half * head_dim / 2 + k` is GGUF's row `2 * k + half`.
    """
    head_size = out_features // num_heads // 2
    index = np.arange(out_features).reshape(num_heads, head_size, 2)
    return index.swapaxes(1, 2).reshape(out_features)


def unpermute_rotary(qw: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """Undo llama.cpp's rotary permutation of a Q or K projection (`num_heads` of that one)."""
    return permute_out(qw, rotary_unpermutation(qw.codes.shape[1], num_heads))
