"""Weight quantization schemes: what each stores and how a float weight becomes it.

A quantized projection (``xlm.models.layers.Linear``) stores its kernel ``[in, out]`` in
the scheme's element type and a float32 ``weight_scale`` ``[G, out]``: G groups along the
input dimension (G == 1: one scale per output channel). The real weight is
``kernel[i, j] * weight_scale[i // (in // G), j]``. Schemes (``--quantization``):

- ``int8``: int8 weights, symmetric per output channel, float activations (W8A16).
- ``w8a8``: int8 weights with a scale per 32 inputs of each output channel (llama.cpp's
  Q8_0 blocks; per output channel where 32 does not divide the input), and activations
  quantized to int8 at run time with a scale per token and block of the same 32 inputs;
  each block's product an exact int8 x int8 -> int32 sum, scaled by both. A
  compressed-tensors checkpoint's w8a8 (per-channel weights, dynamic per-token
  activations: vLLM's and tpu-inference's) keeps its per-channel scales, and its
  activations are quantized per token: the activation blocks follow the weight's groups.

``int8`` and ``w8a8`` also store the embedding table and the LM head (a tied one once) as
int8 with a scale per vocabulary row (w8a8: per block of 32 of the row), the head a
quantized projection (xlm.models.layers.VocabEmbedding); a checkpoint that keeps them
float (compressed-tensors) keeps them float.
- ``fp8``: float8 e4m3 weights per output channel (scale = max |w| / 448), float
  activations (W8A16 in fp8): the kernel is widened to the activations' dtype in the dot
  on every platform, so it saves memory and bandwidth, not dot throughput.
- ``gguf``: a GGUF's own block quants (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) kept as
  int8 codes with float32 scales per group of 16 or 32 inputs and, for the types that have
  one, a per-group ``weight_min``: ``W = kernel * scale + min`` (xlm.models.loader.
  gguf_quants decodes them exactly). One layout for every projection of a model: the
  smallest group among its tensors, a minimum if any has one.
- ``int4``: 4-bit weights, asymmetric per group of 128 inputs (AWQ's, GPTQ's and
  tpu-inference's group; 64 or 32 when 128 does not divide the input or, for a
  row-parallel projection, each tensor-parallel shard of it; else per output channel):
  codes in [0, 15] with a float32 scale and minimum per group, ``W = code * scale + min``
  (``scale = (max - min) / 15``; asymmetric: 16 levels over each group's own range, where
  a symmetric code spends half a level and its sign). Two codes per byte along the input:
  the stored kernel is uint8 ``[in / 2, out]``, byte ``[i, j]`` holding input row ``2i`` in
  its low nibble and row ``2i + 1`` in its high one (``pack_int4``), so a row-parallel
  split of the bytes is a split of the inputs.

Weights are quantized as the loader places each tensor (``quantize_weight``), so no float
copy of the whole model is ever resident; a checkpoint that already holds quantized
tensors and their scales (a GGUF; a compressed-tensors directory, which also names its
scheme: xlm.models.loader.compressed_tensors) is placed as it is. The numpy functions here
are also the reference the tests compare the engine's op against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from xlm.config import QUANTIZATION_METHODS  # noqa: F401  (SCHEMES' keys; re-exported)


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """One ``--quantization`` value."""

    name: str
    weight_dtype: Any  # numpy dtype of the stored kernel
    qmax: float  # the largest magnitude the element type represents (the scale's unit)
    activations: str | None = None  # "int8": dynamic int8 activations (per weight group)
    packed: bool = False  # two 4-bit codes per byte (int4): kernel [in / 2, out]
    # Embedding tables and LM heads are stored in this scheme too (xlm.models.layers.
    # VocabEmbedding); else they stay float.
    embeddings: bool = False
    # Inputs per weight scale when quantized from float weights (None: per output channel).
    group_size: int | None = None
    # int8 kernels the CPU kernel runs are stored in its strips (q8_kernel_strips).
    cpu_strips: bool = False
    # Inputs per weight scale of a kernel quantized from float weights for the CPU kernels
    # (None: `group_size`'s). int8's 32 (llama.cpp Q8_0's blocks): agreement with float32
    # needs them (RESULTS.md, session 17). The kernels' work at each group's end costs
    # nothing measured; the scales' bytes (12.5% of the codes') cost SmolLM2's
    # one-request step about as much. On other platforms XLA's dot scales once, after it.
    cpu_group_size: int | None = None


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """Grouped scales: `group_size` inputs per scale (None: one per output channel), and a
    per-group minimum. A ``gguf`` file's own layout; a compressed-tensors checkpoint's
    (``PER_CHANNEL``)."""

    group_size: int | None
    has_minimum: bool


# A checkpoint whose kernels carry one scale per output channel (compressed-tensors): its
# w8a8 activations are quantized per token, as the checkpoint was made for.
PER_CHANNEL = QuantLayout(None, False)


SCHEMES = {
    "int8": QuantScheme(
        "int8", np.dtype(np.int8), 127.0, embeddings=True, cpu_strips=True, cpu_group_size=32
    ),
    "w8a8": QuantScheme(
        "w8a8",
        np.dtype(np.int8),
        127.0,
        activations="int8",
        embeddings=True,
        group_size=32,
        cpu_strips=True,
    ),
    "fp8": QuantScheme("fp8", np.dtype(ml_dtypes.float8_e4m3fn), 448.0),
    "gguf": QuantScheme("gguf", np.dtype(np.int8), 127.0),
    "int4": QuantScheme("int4", np.dtype(np.uint8), 15.0, packed=True),
}

# int4's group sizes along the input, the first that divides the input (per shard) wins.
INT4_GROUP_SIZES = (128, 64, 32)


def get_scheme(name: str) -> QuantScheme:
    return SCHEMES[name]


def int4_group_size(in_features: int, shards: int = 1) -> int:
    """Inputs per int4 scale: the largest of INT4_GROUP_SIZES dividing `in_features` and,
    split over `shards` (a row-parallel projection's devices), each shard, so that no group
    straddles two devices; else `in_features` (one group: per output channel)."""
    if in_features % 2 or in_features % shards:
        raise ValueError(
            f"in_features={in_features} cannot be stored as int4 over {shards} shard(s): "
            "two codes per byte need an even input width that the shards divide"
        )
    for size in INT4_GROUP_SIZES:
        if (in_features // shards) % size == 0:
            return size
    return in_features


def weight_groups(
    in_features: int, scheme: QuantScheme, layout: QuantLayout | None = None, shards: int = 1
) -> int:
    """How many scales along the input a kernel of `in_features` inputs has (G of its
    [G, out] scales): int4's groups; a checkpoint's own `layout`; else the scheme's
    `group_size` where it divides the input of each of `shards` (a row-parallel
    projection's devices), else one per output channel."""
    if scheme.packed:
        return in_features // int4_group_size(in_features, shards)
    if layout is not None:
        return 1 if layout.group_size is None else in_features // layout.group_size
    size = scheme.group_size
    if size is not None and in_features % (size * shards) == 0:
        return in_features // size
    return 1


# int8 and w8a8 kernels on CPU are stored in strips (xlm.ops.cpu_kernels' int8 and q8
# kernels read each 32-column strip as one sequential stream): kernel [in, out] ->
# [out / 32, in / 4, 32, 4],
# element [s, b, c, r] = kernel[4b + r, 32s + c]; weight_scale [G, out] -> [out / 32, G, 32].
# Array-agnostic (numpy at load, jnp where a program needs the [in, out] kernel back).
Q8_STRIP_COLS, Q8_STRIP_ROWS = 32, 4


def q8_strips_fit(in_features: int, out_features: int, groups: int) -> bool:
    """Whether a kernel can be stored in strips: whole strips of columns, and groups of a
    whole number of 4-row blocks."""
    return (
        out_features % Q8_STRIP_COLS == 0
        and in_features % groups == 0
        and (in_features // groups) % Q8_STRIP_ROWS == 0
    )


def q8_kernel_strips(kernel: Any) -> Any:
    """kernel [in, out] as strips [out / 32, in / 4, 32, 4]."""
    k, n = kernel.shape
    c, r = Q8_STRIP_COLS, Q8_STRIP_ROWS
    return kernel.reshape(k // r, r, n // c, c).transpose(2, 0, 3, 1)


def q8_scale_strips(scale: Any) -> Any:
    """weight_scale [G, out] as strips [out / 32, G, 32]."""
    g, n = scale.shape
    return scale.reshape(g, n // Q8_STRIP_COLS, Q8_STRIP_COLS).transpose(1, 0, 2)


def from_q8_strips(kernel: Any, scale: Any) -> tuple[Any, Any]:
    """(kernel [in, out], scale [G, out]) of a kernel and scale in strips."""
    s, b, c, r = kernel.shape
    g = scale.shape[1]
    return kernel.transpose(1, 3, 0, 2).reshape(b * r, s * c), scale.transpose(1, 0, 2).reshape(
        g, s * c
    )


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """uint8 [in / 2, out] of codes [in, out] in [0, 15]: row 2i in the low nibble of byte
    row i, row 2i + 1 in its high nibble."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[0] % 2 or codes.size and codes.max() > 15:
        raise ValueError(f"int4 codes must be [even, out] in [0, 15]; got {codes.shape}")
    return codes[0::2] | (codes[1::2] << 4)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The codes [in, out] (uint8 in [0, 15]) of a packed int4 kernel [in / 2, out]."""
    packed = np.asarray(packed, np.uint8)
    return np.stack([packed & 15, packed >> 4], axis=1).reshape(-1, packed.shape[1])


def quantize_int4(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed uint8 [in / 2, out], scale [G, out], minimum [G, out]) of a float kernel
    [in, out], asymmetric per `group_size` inputs: code = rint((w - min) / scale)."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"group_size={group_size} must be even and divide in={k}")
    groups = w.reshape(k // group_size, group_size, n)
    low, high = groups.min(axis=1), groups.max(axis=1)
    span = high - low
    scale = np.where(span > 0, span / np.float32(15.0), np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint((groups - low[:, None, :]) / scale[:, None, :]), 0, 15)
    return pack_int4(codes.reshape(k, n)), scale, low.astype(np.float32)


def quantize(
    w: np.ndarray, scheme: QuantScheme, group_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(kernel, weight_scale, weight_min or None) of a float kernel [in, out] under
    `scheme` (the loader's step)."""
    if scheme.packed:
        return quantize_int4(w, group_size or w.shape[0])
    return (*quantize_weight(w, scheme, group_size), None)


def dequantize(
    kernel: np.ndarray,
    scale: np.ndarray,
    minimum: np.ndarray | None,
    scheme: QuantScheme,
) -> np.ndarray:
    """The float32 weight [in, out] a stored kernel (packed or not) stands for."""
    codes = unpack_int4(kernel) if scheme.packed else kernel
    return dequantize_weight(codes, scale, minimum)


def quantize_weight(
    w: np.ndarray, scheme: QuantScheme, group_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(kernel, weight_scale [G, out]) of a float kernel ``w`` [in, out]: symmetric, per
    output channel (G = 1), or per `group_size` inputs of each channel."""
    w = np.asarray(w, np.float32)
    if group_size is not None and group_size != w.shape[0]:
        groups = w.reshape(w.shape[0] // group_size, group_size, w.shape[1])
        parts = [quantize_weight(g, scheme) for g in groups]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    amax = np.abs(w).max(axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(scheme.qmax), np.float32(1.0)).astype(np.float32)
    scaled = w / scale
    if scheme.weight_dtype == np.int8:
        q = np.clip(np.rint(scaled), -scheme.qmax, scheme.qmax).astype(np.int8)
    else:
        q = np.clip(scaled, -scheme.qmax, scheme.qmax).astype(scheme.weight_dtype)
    return q, scale


def dequantize_weight(
    q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None = None
) -> np.ndarray:
    """The float32 weight [in, out] a kernel and its [G, out] scales (and minimums)
    stand for."""
    q = np.asarray(q).astype(np.float32)
    groups = scale.shape[0]
    per_group = q.reshape(groups, q.shape[0] // groups, q.shape[1])
    w = per_group * np.asarray(scale, np.float32)[:, None, :]
    if minimum is not None:
        w = w + np.asarray(minimum, np.float32)[:, None, :]
    return w.reshape(q.shape)


def quantize_activations(x: np.ndarray, groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(int8 x, scale [rows, groups]) symmetric per token (row) and group of `groups` equal
    runs of its inputs: the w8a8 run-time step (groups > 1: Q8_0's blocks of 32)."""
    x = np.asarray(x, np.float32)
    rows, k = x.shape
    blocks = x.reshape(rows, groups, k // groups)
    amax = np.abs(blocks).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(rows, k), scale
