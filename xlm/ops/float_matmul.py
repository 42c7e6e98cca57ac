"""The float projection: y = x @ kernel, kernel [in, out] (or [out, in], `transposed`: an
embedding table used as the LM head, or a projection's kernel stored so) in float32,
float16 or bfloat16.

The native path is XLA's dot on the kernel widened to x's dtype. On CPU the projections'
kernels are stored [out, in] (`prefers_out_major`, xlm.models.layers.Linear) and steps of
few rows run xlm.ops.cpu_kernels.float_matmul, whose rows-of-w path reads each weight once
as long sequential streams: float32 kernels at up to ``FLOAT_KERNEL_MAX_ROWS`` rows (a
decode of one request to a few), half-precision ones at up to ``HALF_KERNEL_MAX_ROWS``
(decode of one request to a batch, and short prefills: XLA:CPU converts the whole matrix
before its dot, every step, which made half weights several times slower than float32 ones
at one row and ~1.9x slower at 64; docs/engine.md, "Float and half weights on CPU"). Above,
the kernel widens each tile of half weights once into a float32 buffer that all rows use (a
GEMM's packing); past ``HALF_KERNEL_MAX_ROWS`` rows XLA's convert is paid once for many rows
and its GEMM wins, and float32 steps of more than ``FLOAT_KERNEL_MAX_ROWS`` rows take XLA's
dot on [out, in]. Chosen by shape at trace time; a tensor-parallel mesh or unavailable
kernels take the native path (``FloatMatmul.float32_kernel`` off: float32 kernels [in, out]
and XLA's dot at every row count, the path before; benchmarks/RESULTS.md, session 13).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from xlm.distributed.mesh import tp_mesh
from xlm.ops.cpu_kernels import available as cpu_kernels_available
from xlm.ops.cpu_kernels import float_matmul
from xlm.ops.cpu_kernels import start_build as start_cpu_kernels_build
from xlm.ops.custom_op import CustomOp

# Rows up to which the CPU kernel replaces XLA's dot: float32 weights (when
# FloatMatmul.float32_kernel is on, the default; a matrix-vector-like step) and half weights.
FLOAT_KERNEL_MAX_ROWS = 8
HALF_KERNEL_MAX_ROWS = 256
HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


@CustomOp.register("float_matmul")
class FloatMatmul(CustomOp):
    """x [..., in] @ kernel -> [..., out] in x's dtype (`transposed`, kernel [out, in]:
    float32, as logits are)."""

    default_enabled = True
    # Whether float32 kernels take the CPU kernel too (stored [out, in]; at one request
    # 1.26x XLA's dot on [in, out] in the step, a batch of 64 level: RESULTS.md, session 13).
    float32_kernel: ClassVar[bool] = True

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if self._forward_name == "forward_cpu":
            start_cpu_kernels_build()

    def forward_native(
        self, x: jax.Array, kernel: jax.Array, transposed: bool = False
    ) -> jax.Array:
        if transposed:  # the LM head: logits in float32
            return jnp.einsum(
                "...h,vh->...v", x, kernel.astype(x.dtype), preferred_element_type=jnp.float32
            )
        return x @ kernel.astype(x.dtype)

    def prefers_out_major(self, dtype: Any) -> bool:
        """Whether a projection's kernel of `dtype` is best stored [out, in] for this op
        (xlm.models.layers.Linear): where the CPU kernel runs it (a CPU platform with the
        op on; half weights, float32 ones with `float32_kernel`), whose few-rows path reads
        rows of w as long sequential streams, faster than columns of [in, out]
        (cpu_kernels/float_matmul.cc). Longer steps run XLA's dot on [out, in] as they do
        for the LM head."""
        return self._forward_name == "forward_cpu" and self.kernel_takes(dtype)

    def kernel_takes(self, dtype: Any) -> bool:
        """Whether the CPU kernel takes weights of `dtype`: half ones, float32 ones while
        `float32_kernel` is on."""
        dtype = jnp.dtype(dtype)
        return dtype in HALF_DTYPES or (dtype == jnp.float32 and self.float32_kernel)

    def uses_kernel(self, x: jax.Array, kernel: jax.Array) -> bool:
        """Whether forward_cpu runs the CPU kernel for these shapes and dtypes."""
        rows = math.prod(x.shape[:-1])
        half = jnp.dtype(kernel.dtype) in HALF_DTYPES
        return (
            1 <= rows <= (HALF_KERNEL_MAX_ROWS if half else FLOAT_KERNEL_MAX_ROWS)
            and self.kernel_takes(kernel.dtype)
            and jnp.dtype(x.dtype) in (jnp.float32, *HALF_DTYPES)
            and tp_mesh() is None  # no partitioning rule: XLA would gather the kernel
            and cpu_kernels_available()
        )

    def forward_cpu(self, x: jax.Array, kernel: jax.Array, transposed: bool = False) -> jax.Array:
        if not self.uses_kernel(x, kernel):
            return self.forward_native(x, kernel, transposed)
        y = float_matmul(x, kernel, transposed=transposed)
        return y if transposed else y.astype(x.dtype)
