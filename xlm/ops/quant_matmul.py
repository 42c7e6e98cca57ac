"""The quantized projection: y = x @ (kernel * weight_scale), one op per scheme.

``kernel`` is ``[in, out]`` in the scheme's element type (int8 or float8 e4m3), or for
``int4`` uint8 ``[in / 2, out]`` holding two 4-bit codes per byte (row 2i low nibble,
2i + 1 high; xlm.quantization.pack_int4), unpacked by shifts and masks in the program,
``weight_scale`` ``[G, out]`` float32 and, for GGUF types with one, ``weight_min``
``[G, out]``: W = kernel * scale + min per group of in / G inputs (xlm.quantization).
The native path is the definition in jnp: weight-only schemes convert the kernel
inside the dot (XLA fuses the convert); ``w8a8`` quantizes each token's activations to
int8 in blocks that follow the weight's groups (one per token for per-channel weights,
per group of 32 from float weights) and sums each block's int8 x int8 products exactly in
int32, then scales by both. Platform paths take the same arguments.

On CPU, XLA widens the whole int8 matrix before its dot, which made a one-row (decode)
int8 projection slower than the float32 one it replaces; ``forward_cpu`` runs int8
kernels through xlm.ops.cpu_kernels (an FFI kernel that streams the int8 bytes once, on
XLA's own threads) for every row count of the weight-only schemes. w8a8 up to
``W8A8_KERNEL_MAX_ROWS`` rows runs its int8 x int8 variant (AVX2 maddubs/madd, exact int32
sums per group, as llama.cpp's Q8_0 x Q8_0), which quantizes the activations itself
(``q8_linear``: one call, no XLA fusion before it); beyond, per-token w8a8 takes XLA's int8 x
int8 dot (faster there: benchmarks/quant_matmul.py) and grouped w8a8 the weight-only
kernel's GEMM on the rounded activations. A w8a8 kernel stored in strips (the loader's
layout for it on CPU without tensor parallelism: xlm.quantization.q8_kernel_strips, each
32-column strip one sequential stream) runs the int8 x int8 kernel at every row count, an
int8 one (also stored so) the weight-only kernel on strips; the native path turns strips
back into ``[in, out]`` first. fp8 kernels, and any step under a
tensor-parallel mesh (the FFI call has no partitioning rule), take the native path. int4
kernels run through the kernel's int4 variant, which reads each packed byte once, unpacks
it in registers and adds the minimums' term itself, at every row count (faster than the
native unpack + dot at 1 to 64 rows: benchmarks/quant_matmul.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xlm.distributed.mesh import tp_mesh
from xlm.ops.cpu_kernels import available as cpu_kernels_available
from xlm.ops.cpu_kernels import int4_matmul, int8_matmul, q8_linear, quantize_activations
from xlm.ops.cpu_kernels import start_build as start_cpu_kernels_build
from xlm.ops.custom_op import CustomOp
from xlm.quantization import from_q8_strips


def dequantize_activations(xq: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 activations [m, k] int8 ones and their [m, G] scales stand for."""
    m, k = xq.shape
    blocks = xq.astype(jnp.float32).reshape(m, scale.shape[1], -1) * scale[:, :, None]
    return blocks.reshape(m, k)


def _plus_minimums(y: jax.Array, x2: jax.Array, minimum: jax.Array | None) -> jax.Array:
    """y + each group's input sum times its minimum (GGUF types with one; else y)."""
    if minimum is None:
        return y
    groups = minimum.shape[0]
    sums = x2.reshape(x2.shape[0], groups, -1).sum(-1, dtype=jnp.float32)
    return y + jnp.dot(sums, minimum, preferred_element_type=jnp.float32)


def unpack_int4(kernel: jax.Array) -> jax.Array:
    """The codes [in, out] (uint8 in [0, 15]) of a packed int4 kernel [in / 2, out]."""
    rows, out = kernel.shape
    return jnp.stack([kernel & 15, kernel >> 4], axis=1).reshape(2 * rows, out)


# w8a8 on CPU: rows up to which the FFI kernel (on the rounded activations) beats XLA's
# int8 x int8 dot (benchmarks/quant_matmul.py: 3.5x at 1 row, 1.4x at 8, 0.7x at 64).
W8A8_KERNEL_MAX_ROWS = 16


@CustomOp.register("quant_matmul")
class QuantMatmul(CustomOp):
    """x [..., in] @ dequantized kernel -> [..., out] in x's dtype."""

    # Platform kernels are used wherever they exist (CPU: the int8 FFI kernel).
    default_enabled = True

    def __init__(self, activations: str | None = None, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.activations = activations
        if self._forward_name == "forward_cpu":
            # Built in the background from now; the loader waits for it before it returns
            # the model, so a saved program that calls the kernel loads without tracing.
            start_cpu_kernels_build()

    def runs_cpu_kernel(self) -> bool:
        """Whether this op dispatches to the CPU kernels (the platform is a CPU and
        custom_ops leaves the op on): its w8a8 kernels may then be stored in strips."""
        return self._forward_name == "forward_cpu"

    def forward_native(
        self,
        x: jax.Array,
        kernel: jax.Array,
        scale: jax.Array,
        minimum: jax.Array | None = None,
    ) -> jax.Array:
        if kernel.ndim == 4:  # in strips (kernel-less fallback): back to [in, out]
            kernel, scale = from_q8_strips(kernel, scale)
        if kernel.dtype == jnp.uint8:  # int4: fused into the dot's operand by XLA
            kernel = unpack_int4(kernel)
        groups, out = scale.shape
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.activations == "int8":  # blocks of the weight's groups
            xq, xs = quantize_activations(x2, groups)
            if groups == 1:
                acc = jax.lax.dot_general(
                    xq, kernel, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
                )
                y = acc.astype(jnp.float32) * xs * scale
                return y.astype(x.dtype).reshape(*lead, out)
            # Each block's int8 x int8 sum exact in int32 (the CPU kernel's), then scaled.
            g = k // groups
            acc = jnp.einsum(
                "mgi,gio->mgo",
                xq.reshape(-1, groups, g),
                kernel.reshape(groups, g, out),
                preferred_element_type=jnp.int32,
            )
            y = jnp.sum(acc.astype(jnp.float32) * (xs[:, :, None] * scale), axis=1)
            return y.astype(x.dtype).reshape(*lead, out)
        if groups == 1:
            y = jnp.dot(x2, kernel.astype(x2.dtype), preferred_element_type=jnp.float32) * scale
        else:
            g = k // groups
            partial = jnp.einsum(
                "mgi,gio->mgo",
                x2.reshape(-1, groups, g),
                kernel.reshape(groups, g, out).astype(x2.dtype),
                preferred_element_type=jnp.float32,
            )
            y = jnp.einsum("mgo,go->mo", partial, scale)
        return _plus_minimums(y, x2, minimum).astype(x.dtype).reshape(*lead, out)

    def forward_cpu(
        self,
        x: jax.Array,
        kernel: jax.Array,
        scale: jax.Array,
        minimum: jax.Array | None = None,
    ) -> jax.Array:
        lead, k = x.shape[:-1], x.shape[-1]
        w8a8 = self.activations == "int8"
        strips = kernel.ndim == 4  # in the kernel's strips: [out / 32, G, 32] scales
        rows, groups = math.prod(lead), scale.shape[1 if strips else 0]
        if (
            kernel.dtype not in (jnp.int8, jnp.uint8)
            # Per token, many rows: XLA's int8 x int8 dot.
            or (w8a8 and groups == 1 and rows > W8A8_KERNEL_MAX_ROWS and not strips)
            or tp_mesh() is not None  # no partitioning rule: XLA would gather the kernel
            or not cpu_kernels_available()
        ):
            return self.forward_native(x, kernel, scale, minimum)
        x2 = x.reshape(-1, k).astype(jnp.float32)
        if w8a8:
            # int8 x int8, exact int32 sums per group, the kernel quantizing x itself; in
            # strips at every row count.
            if strips or rows <= W8A8_KERNEL_MAX_ROWS:
                return q8_linear(x2, kernel, scale).astype(x.dtype).reshape(*lead, -1)
            xq, xs = quantize_activations(x2, groups)
            # More rows in groups: the same rounded activations through the weight-only
            # kernel's GEMM, whose float sums of these products are the same sums.
            x2 = dequantize_activations(xq, xs)
        if kernel.dtype == jnp.uint8:  # int4: the kernel adds the minimums' term itself
            y = int4_matmul(x2, kernel, scale, minimum)
        else:
            y = _plus_minimums(int8_matmul(x2, kernel, scale), x2, minimum)
        return y.astype(x.dtype).reshape(*lead, -1)
