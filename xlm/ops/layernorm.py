"""RMSNorm, with an optional fused residual add."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.ops.custom_op import CustomOp


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """Root-mean-square norm: x / rms(x) * (weight + weight_offset), computed in float32."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: jnp.dtype = jnp.float32,
        weight_offset: float = 0.0,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight_offset = weight_offset
        init = 0.0 if weight_offset else 1.0
        self.weight = nnx.Param(jnp.full((hidden_size,), init, dtype=dtype))

    def forward_native(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        xf = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        normed = (xf * jax.lax.rsqrt(variance + self.eps)).astype(orig_dtype)
        weight = self.weight[...]
        if self.weight_offset:
            weight = weight.astype(jnp.float32) + self.weight_offset
        out = (normed * weight).astype(orig_dtype)
        return out if residual is None else (out, residual)


@CustomOp.register("layer_norm")
class LayerNorm(CustomOp):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, in float32."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        dtype: jnp.dtype = jnp.float32,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype=dtype))
        self.bias = nnx.Param(jnp.zeros((hidden_size,), dtype=dtype)) if bias else None

    def forward_native(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        out = (xf - mean) * jax.lax.rsqrt(variance + self.eps) * self.weight[...]
        if self.bias is not None:
            out = out + self.bias[...]
        return out.astype(x.dtype)
